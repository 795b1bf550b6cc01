//! The command-line grammar every example shares (included with `#[path]`, no dependency):
//!
//! ```text
//! EXAMPLE [POSITIONAL]... [--flag | --flag VALUE | --flag=VALUE]...
//! ```
//!
//! - `--help` or `-h`, anywhere: the usage on stdout, exit code 0.
//! - A usage error — an unknown flag, an argument where none is taken, a flag given twice, a
//!   flag's missing or unparsable value (`--sequences abc`), a value given to a flag that takes
//!   none, a flag that applies only with another, flags that exclude each other — prints
//!   `error: …` naming the flag or argument, then the usage, on stderr: exit code 2.
//! - A failure while running: `error: …` (the error's `Display`) on stderr, exit code 1
//!   ([`exit`]).
//!
//! Each example writes its own usage text (its first line `usage: EXAMPLE …`) and matches its own
//! flags; this module reads them.

// Each example uses the part of this module it needs.
#![allow(dead_code)]

use std::fmt::Display;
use std::process::ExitCode;
use std::str::FromStr;

/// One argument of the command line.
pub enum Arg {
    /// `--name` or `-x` (of `--name=value`, the name; [`Args::value`] reads the value).
    Flag(String),
    /// Anything else: a mode, a count.
    Positional(String),
}

/// An example's command line, read one argument at a time.
pub struct Args {
    usage: &'static str,
    rest: std::vec::IntoIter<String>,
    /// The last flag read, and the value given with it as `--flag=value`, until read.
    inline: Option<(String, String)>,
    given: Vec<String>,
}

impl Args {
    /// The process's arguments. With `--help` or `-h` among them, prints `usage` on stdout and
    /// exits with code 0.
    pub fn new(usage: &'static str) -> Self {
        Self::from_vec(usage, std::env::args().skip(1).collect())
    }

    /// These arguments (the program's name not among them).
    pub fn from_vec(usage: &'static str, args: Vec<String>) -> Self {
        if args.iter().any(|a| a == "--help" || a == "-h") {
            println!("{usage}");
            std::process::exit(0);
        }
        Self {
            usage,
            rest: args.into_iter(),
            inline: None,
            given: Vec::new(),
        }
    }

    /// The next argument. A flag given twice is a usage error.
    pub fn next_arg(&mut self) -> Option<Arg> {
        if let Some((flag, _)) = self.inline.take() {
            self.error(format_args!("{flag} takes no value"));
        }
        let arg = self.rest.next()?;
        if !is_flag(&arg) {
            return Some(Arg::Positional(arg));
        }
        let flag = match arg.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") => {
                self.inline = Some((flag.to_string(), value.to_string()));
                flag.to_string()
            }
            _ => arg,
        };
        if self.given.contains(&flag) {
            self.error(format_args!("{flag} is given twice"));
        }
        self.given.push(flag.clone());
        Some(Arg::Flag(flag))
    }

    /// The value of `flag`, the flag just read: the next argument (or what follows its `=`),
    /// parsed. Missing or unparsable, a usage error that names the flag and the value.
    pub fn value<T: FromStr>(&mut self, flag: &str) -> T
    where
        T::Err: Display,
    {
        let text = match self.inline.take() {
            Some((_, value)) => value,
            None => match self.rest.next() {
                Some(value) if !is_flag(&value) => value,
                _ => self.error(format_args!("{flag} needs a value")),
            },
        };
        self.parse(flag, &text)
    }

    /// `text`, the argument `what`, parsed; unparsable, a usage error that names both.
    pub fn parse<T: FromStr>(&self, what: &str, text: &str) -> T
    where
        T::Err: Display,
    {
        text.parse()
            .unwrap_or_else(|e| self.error(format_args!("{what} {text:?}: {e}")))
    }

    /// An argument the example does not take: a usage error that names it.
    pub fn unknown(&self, arg: Arg) -> ! {
        match arg {
            Arg::Flag(flag) => self.error(format_args!("unknown flag {flag}")),
            Arg::Positional(arg) => self.error(format_args!("unexpected argument {arg:?}")),
        }
    }

    /// Whether `flag` was given.
    pub fn given(&self, flag: &str) -> bool {
        self.given.iter().any(|f| f == flag)
    }

    /// A usage error if `flag` was given without `with`.
    pub fn only_with(&self, flag: &str, with: &str) {
        if self.given(flag) && !self.given(with) {
            self.error(format_args!("{flag} applies only with {with}"));
        }
    }

    /// A usage error if more than one of `flags` was given.
    pub fn at_most_one(&self, flags: &[&str]) {
        let given: Vec<&str> = flags.iter().copied().filter(|f| self.given(f)).collect();
        if let [first, second, ..] = given[..] {
            self.error(format_args!("{first} and {second} exclude each other"));
        }
    }

    /// A usage error: `error: {why}` and the usage on stderr, exit code 2.
    pub fn error(&self, why: impl Display) -> ! {
        eprintln!("error: {why}\n\n{}", self.usage);
        std::process::exit(2)
    }
}

/// `-x`, `--name`, `--name=value`: a flag (a lone `-` is not one).
fn is_flag(arg: &str) -> bool {
    arg.len() > 1 && arg.starts_with('-')
}

/// The command line `[MODE] [COUNT]` of the instruction-counting examples: `MODE` one of
/// `modes`, `COUNT` a whole number (`count` names it in errors); `default` where they are not
/// given. Takes no flag but `--help`.
pub fn mode_and_count(
    usage: &'static str,
    modes: &[&'static str],
    count: &str,
    default: (&'static str, u64),
) -> (&'static str, u64) {
    let mut args = Args::new(usage);
    let mut positional = Vec::new();
    while let Some(arg) = args.next_arg() {
        match arg {
            Arg::Positional(p) if positional.len() < 2 => positional.push(p),
            other => args.unknown(other),
        }
    }
    let mode = match positional.first() {
        None => default.0,
        Some(m) => modes.iter().copied().find(|x| x == m).unwrap_or_else(|| {
            args.error(format_args!(
                "MODE {m:?} is not one of {}",
                modes.join(", ")
            ))
        }),
    };
    let n = positional
        .get(1)
        .map_or(default.1, |n| args.parse(count, n));
    (mode, n)
}

/// The exit of an example's `main`: 0, or, for an error, `error: {e}` (its `Display`) on
/// stderr and 1.
pub fn exit<E: Display>(result: Result<(), E>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
