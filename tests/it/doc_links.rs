//! The README and the guides link only to what resolves wherever they are read.
//!
//! The README is shown on GitHub and on crates.io (which has no repository to resolve a relative
//! link against); each guide under `docs/` on GitHub and, included by `src/guide.rs`, in the
//! crate's documentation on docs.rs (rustdoc cannot follow a link to a `.md` file). So a link
//! in them is an absolute address or an anchor of the same page, never a relative path: a guide
//! is linked by its docs.rs page (`https://docs.rs/memtoken/latest/memtoken/guide/<name>/…`), an
//! item by its docs.rs page, and a file of the package by docs.rs's source view
//! (`https://docs.rs/crate/memtoken/latest/source/<path>`). The docs.rs addresses of this crate
//! are checked against the repository: the guide module, the module or the packaged file must
//! exist.

use std::fs;
use std::path::{Path, PathBuf};

/// A guide's page on docs.rs, followed by `<module>/index.html`.
const GUIDE: &str = "https://docs.rs/memtoken/latest/memtoken/guide/";
/// Any other page of this crate's documentation, followed by a module path and a page.
const ITEMS: &str = "https://docs.rs/memtoken/latest/memtoken/";
/// A file of the published package in docs.rs's source view, followed by its path.
const SOURCE: &str = "https://docs.rs/crate/memtoken/latest/source/";

/// The files under `docs/` that are not in the crate's documentation, each for its reason: read
/// on GitHub (or in docs.rs's source view) only.
const NOT_RENDERED_BY_RUSTDOC: &[&str] = &[
    "docs/benchmarks.md", // the measurements: method, counts, paired runs
    "docs/layout.md",     // the repository's files, for those who change them
];

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(relative: &str) -> String {
    fs::read_to_string(root().join(relative)).unwrap_or_else(|e| panic!("{relative}: {e}"))
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path, found: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, found);
        } else if path.extension().is_some_and(|e| e == "rs") {
            found.push(path);
        }
    }
}

/// `relative` (with `..` and `.` in it) from `dir`, as a path from the crate's root.
fn lexical_join(dir: &Path, relative: &str) -> String {
    let mut parts: Vec<&str> = dir.iter().map(|p| p.to_str().unwrap()).collect();
    for part in relative.split('/') {
        match part {
            ".." => assert!(parts.pop().is_some(), "{relative} leaves the crate"),
            "." | "" => {}
            part => parts.push(part),
        }
    }
    parts.join("/")
}

/// The Markdown files rustdoc renders or tests: each `include_str!` of a `.md` file under `src/`
/// (the README's, the guides', the CUDA facts'), as paths from the crate's root.
fn markdown_rustdoc_reads() -> Vec<String> {
    let mut sources = Vec::new();
    rust_files(&root().join("src"), &mut sources);
    let mut found = Vec::new();
    for source in sources {
        let text = fs::read_to_string(&source).unwrap();
        for piece in text.split("include_str!(\"").skip(1) {
            let included = &piece[..piece.find('"').unwrap()];
            if included.ends_with(".md") {
                let dir = source.parent().unwrap().strip_prefix(root()).unwrap();
                found.push(lexical_join(dir, included));
            }
        }
    }
    found.sort();
    found.dedup();
    found
}

/// Each link target in `markdown`, with its line (from 1): inline links and images
/// (`[text](target)`), reference definitions (`[label]: target`) and HTML `href`/`src`
/// attributes, outside fenced code blocks.
fn link_targets(markdown: &str) -> Vec<(usize, String)> {
    let mut targets = Vec::new();
    let mut fenced = false;
    for (i, line) in markdown.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut push = |rest: &str, end: &[char]| {
            let target = rest.trim_start().split(end).next().unwrap_or("");
            targets.push((i + 1, target.to_owned()));
        };
        for rest in line.split("](").skip(1) {
            push(rest, &[')', ' ']);
        }
        for attribute in ["href=\"", "src=\""] {
            for rest in line.split(attribute).skip(1) {
                push(rest, &['"']);
            }
        }
        let trimmed = line.trim_start();
        if trimmed.starts_with('[')
            && let Some(close) = trimmed.find("]:")
        {
            push(&trimmed[close + 2..], &[' ']);
        }
    }
    targets
}

/// The paths that Cargo.toml's `exclude` leaves out of the package (each `"/…"` entry).
fn excluded_from_package() -> Vec<String> {
    let manifest = read("Cargo.toml");
    let start = manifest
        .find("exclude = [")
        .expect("Cargo.toml has an exclude list");
    let list = &manifest[start..start + manifest[start..].find(']').unwrap()];
    list.lines()
        .filter_map(|line| line.trim().strip_prefix("\"/"))
        .map(|entry| entry.trim_end_matches(['"', ',']).to_owned())
        .collect()
}

/// Why `target` would not resolve both on GitHub or crates.io and on docs.rs, if it would not.
fn why_unresolved(target: &str, guides: &[String], excluded: &[String]) -> Option<String> {
    let page = target.split('#').next().unwrap_or("");
    if target.starts_with('#') {
        None
    } else if let Some(rest) = page.strip_prefix(GUIDE) {
        let module = rest.strip_suffix("/index.html").unwrap_or(rest);
        let known = rest == "index.html" || guides.iter().any(|g| g == module);
        (!known).then(|| format!("no guide module `{module}` in src/guide.rs"))
    } else if let Some(rest) = page.strip_prefix(ITEMS) {
        let module = rest.rsplit_once('/').map_or("", |(module, _)| module);
        let file = root().join("src").join(module);
        let exists = module.is_empty()
            || file.with_extension("rs").is_file()
            || file.join("mod.rs").is_file();
        (!exists).then(|| format!("no module `{module}` under src/"))
    } else if let Some(path) = page.strip_prefix(SOURCE) {
        if !root().join(path).exists() {
            Some(format!("no file `{path}` in the repository"))
        } else if excluded.iter().any(|e| path.starts_with(e.as_str())) {
            Some(format!(
                "`{path}` is excluded from the package (Cargo.toml)"
            ))
        } else {
            None
        }
    } else if target.starts_with("https://") || target.starts_with("http://") {
        None
    } else {
        Some("a relative link: it resolves on neither crates.io nor docs.rs".to_owned())
    }
}

/// The guide modules `src/guide.rs` declares.
fn guide_modules() -> Vec<String> {
    read("src/guide.rs")
        .lines()
        .filter_map(|line| line.trim().strip_prefix("pub mod "))
        .map(|rest| rest.split([' ', '{', ';']).next().unwrap().to_owned())
        .collect()
}

/// Every link in the README and in each Markdown file rustdoc includes is an anchor or an
/// absolute address, and each docs.rs address of this crate names what exists.
#[test]
#[cfg_attr(
    miri,
    ignore = "reads and scans the documents, no memory of memtoken's: nothing for Miri to check, and slow under it"
)]
fn the_readme_and_the_guides_have_no_link_that_breaks_off_github() {
    let (guides, excluded) = (guide_modules(), excluded_from_package());
    assert!(
        guides.len() >= 10,
        "guide modules found in src/guide.rs: {guides:?}"
    );
    let files = markdown_rustdoc_reads();
    assert!(files.contains(&"README.md".to_owned()), "{files:?}");
    assert!(files.contains(&"docs/tokens.md".to_owned()), "{files:?}");
    let mut wrong = Vec::new();
    let mut checked = 0;
    for file in &files {
        for (line, target) in link_targets(&read(file)) {
            checked += 1;
            if let Some(why) = why_unresolved(&target, &guides, &excluded) {
                wrong.push(format!("{file}:{line}: ({target}): {why}"));
            }
        }
    }
    assert!(checked > 30, "only {checked} links found in {files:?}");
    assert!(
        wrong.is_empty(),
        "links that break off GitHub:\n{}",
        wrong.join("\n")
    );
}

/// Every Markdown file under `docs/` is either in the crate's documentation (so its snippets
/// are doc-tested and its links checked above) or named as not.
#[test]
#[cfg_attr(
    miri,
    ignore = "reads and scans the documents, no memory of memtoken's: nothing for Miri to check, and slow under it"
)]
fn every_file_under_docs_is_a_guide_or_named_as_not() {
    let in_docs = markdown_rustdoc_reads();
    let mut unplaced = Vec::new();
    for entry in fs::read_dir(root().join("docs")).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        let path = format!("docs/{name}");
        if name.ends_with(".md")
            && !in_docs.contains(&path)
            && !NOT_RENDERED_BY_RUSTDOC.contains(&path.as_str())
        {
            unplaced.push(path);
        }
    }
    assert!(
        unplaced.is_empty(),
        "include each in src/guide.rs, or name it in NOT_RENDERED_BY_RUSTDOC: {unplaced:?}"
    );
}

/// The checker refuses what it should: a relative link, in each form, and docs.rs addresses
/// of what does not exist; it lets through anchors, other sites and what exists.
#[test]
#[cfg_attr(
    miri,
    ignore = "reads and scans the documents, no memory of memtoken's: nothing for Miri to check, and slow under it"
)]
fn the_link_checker_refuses_relative_links_and_unknown_docs_rs_pages() {
    let guides = vec!["tokens".to_owned()];
    let excluded = vec!["tests/".to_owned()];
    let links = link_targets(
        "[a](sharing.md) ![b](docs/benchmarks.svg)\n[c]: ../GUARANTEES.md\n<a href=\"x.md\">\n\
         ```\nlet v = f[0](1);\n```\n[d](#peers) [e](https://example.com/x)",
    );
    let targets: Vec<_> = links.iter().map(|(line, t)| (*line, t.as_str())).collect();
    assert_eq!(
        targets,
        [
            (1, "sharing.md"),
            (1, "docs/benchmarks.svg"),
            (2, "../GUARANTEES.md"),
            (3, "x.md"),
            (7, "#peers"),
            (7, "https://example.com/x"),
        ]
    );
    let refused = |t: &str| why_unresolved(t, &guides, &excluded).is_some();
    for (_, target) in &targets[..4] {
        assert!(refused(target), "{target}");
    }
    assert!(!refused("#peers") && !refused("https://example.com/x"));
    assert!(!refused(&format!(
        "{GUIDE}tokens/index.html#finishing-a-release"
    )));
    assert!(!refused(&format!("{GUIDE}index.html")));
    assert!(refused(&format!("{GUIDE}nonesuch/index.html")));
    assert!(!refused(&format!("{ITEMS}backend/cuda/facts/index.html")));
    assert!(!refused(&format!("{ITEMS}kv/struct.KvCache.html")));
    assert!(refused(&format!("{ITEMS}nonesuch/index.html")));
    assert!(!refused(&format!("{SOURCE}GUARANTEES.md")));
    assert!(refused(&format!("{SOURCE}tests/it/main.rs")));
    assert!(refused(&format!("{SOURCE}no-such-file.md")));
}
