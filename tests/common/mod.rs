//! Helpers shared by the integration tests: reading an error's `source()` chain.

use std::error::Error;

/// The messages along `err`'s `source()` chain, `err`'s own first.
pub fn messages(err: &dyn Error) -> Vec<String> {
    let mut out = vec![err.to_string()];
    let mut next = err.source();
    while let Some(e) = next {
        out.push(e.to_string());
        next = e.source();
    }
    out
}

/// Each message says its own part: none repeats the text of a cause further down the chain.
pub fn assert_no_cause_repeated(err: &dyn Error) {
    let all = messages(err);
    for (i, message) in all.iter().enumerate() {
        for cause in &all[i + 1..] {
            assert!(
                !message.contains(cause.as_str()),
                "{message:?} repeats {cause:?}"
            );
        }
    }
}
