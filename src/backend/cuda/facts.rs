#![doc = include_str!("../../../docs/cuda-facts.md")]

/// The check that every "fact N" the code cites is an entry of the document above.
#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::fs;
    use std::path::{Path, PathBuf};

    /// The facts document, as the module's docs include it.
    const DOC: &str = include_str!("../../../docs/cuda-facts.md");

    /// One citation: where it is, its words, and the fact numbers it names.
    #[derive(Debug)]
    struct Citation {
        /// 1-based line of the word "fact".
        line: usize,
        /// The citation as written, from "fact" to its last number.
        text: String,
        /// Every number it names, ranges expanded.
        facts: Vec<u32>,
        /// Why it cannot be read, if it cannot (a range that runs backwards).
        error: Option<&'static str>,
    }

    /// A cursor over the text after the word "fact" or "facts".
    struct Cursor<'a> {
        s: &'a str,
        i: usize,
    }

    impl<'a> Cursor<'a> {
        fn rest(&self) -> &'a str {
            &self.s[self.i..]
        }

        /// Skips spaces and tabs, and a line break only into a comment line (`//`, `///`,
        /// `//!`), so that a citation wrapped across doc-comment lines is still read.
        fn skip_space(&mut self) {
            loop {
                let rest = self.rest();
                let t = rest.trim_start_matches([' ', '\t']);
                self.i += rest.len() - t.len();
                let Some(next) = t.strip_prefix("\r\n").or_else(|| t.strip_prefix('\n')) else {
                    return;
                };
                let next = next.trim_start_matches([' ', '\t']);
                let Some(comment) = next.strip_prefix("//") else {
                    return;
                };
                let comment = comment.strip_prefix(['/', '!']).unwrap_or(comment);
                self.i = self.s.len() - comment.len();
            }
        }

        /// Eats `word` if the text goes on with it.
        fn eat(&mut self, word: &str) -> bool {
            let hit = self.rest().starts_with(word);
            if hit {
                self.i += word.len();
            }
            hit
        }

        /// A number of up to four digits not followed by a letter or digit.
        fn number(&mut self) -> Option<u32> {
            let rest = self.rest();
            let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
            let after = rest[digits..].chars().next();
            if digits == 0 || digits > 4 || after.is_some_and(|c| c.is_alphanumeric()) {
                return None;
            }
            self.i += digits;
            rest[..digits].parse().ok()
        }

        /// `N` or `N–M` (en dash, hyphen or em dash, spaces allowed around it).
        fn item(&mut self, facts: &mut Vec<u32>, error: &mut Option<&'static str>) -> bool {
            let Some(first) = self.number() else {
                return false;
            };
            let before_dash = self.i;
            self.skip_space();
            if self.eat("–") || self.eat("-") || self.eat("—") {
                self.skip_space();
                if let Some(last) = self.number() {
                    if last < first {
                        *error = Some("a range that runs backwards");
                    }
                    facts.extend(first..=last.max(first));
                    return true;
                }
            }
            self.i = before_dash;
            facts.push(first);
            true
        }

        /// After a separator, skips a line break of any kind too — into a comment line, a
        /// block comment's `* ` or a plain line of a document — so a list wrapped anywhere is
        /// read whole.
        fn skip_space_and_breaks(&mut self) {
            self.skip_space();
            let rest = self.rest();
            let Some(next) = rest
                .strip_prefix("\r\n")
                .or_else(|| rest.strip_prefix('\n'))
            else {
                return;
            };
            let next = next.trim_start_matches([' ', '\t']);
            let next = next.strip_prefix("* ").unwrap_or(next);
            if next.starts_with(|c: char| c.is_ascii_digit()) {
                self.i = self.s.len() - next.len();
            }
        }

        /// A separator between items — `, `, ` and `, `, and `, ` or ` — followed by an item.
        fn next_item(&mut self, facts: &mut Vec<u32>, error: &mut Option<&'static str>) -> bool {
            let start = self.i;
            let comma = self.eat(",");
            self.skip_space_and_breaks();
            let word = self.eat("and") || self.eat("or");
            if word {
                self.skip_space_and_breaks();
            }
            if (comma || word) && self.i > start && self.item(facts, error) {
                return true;
            }
            self.i = start;
            false
        }
    }

    /// Every citation of a fact in `text`: "fact 27", "facts 39–43" (a range, with an en dash
    /// or a hyphen), "facts 14, 15 and 16", "(fact 15)", "Fact 14:". The word is matched
    /// whole and in any case ("artifact 3" is no citation), and a "fact" not followed by a
    /// number ("the facts sheet") is none either.
    fn citations(text: &str) -> Vec<Citation> {
        // ASCII lower case keeps every byte where it was.
        let lower = text.to_ascii_lowercase();
        let mut out = Vec::new();
        for (at, _) in lower.match_indices("fact") {
            let whole = at == 0
                || !lower[..at]
                    .chars()
                    .next_back()
                    .is_some_and(|c| c.is_alphanumeric() || c == '_');
            if !whole {
                continue;
            }
            let mut cur = Cursor {
                s: text,
                i: at + "fact".len(),
            };
            let _ = cur.eat("s") || cur.eat("S");
            let spaced = cur.i;
            cur.skip_space();
            if cur.i == spaced {
                continue; // "factor", "facts:", ...
            }
            let (mut facts, mut error) = (Vec::new(), None);
            if !cur.item(&mut facts, &mut error) {
                continue;
            }
            while cur.next_item(&mut facts, &mut error) {}
            // A connector this parser does not read, between this number and another, would
            // hide the rest of the citation: it is an error, not a shorter citation.
            let end = cur.i;
            cur.skip_space();
            let unknown = [
                "to ", "through ", "/", "&", "\u{2212}", "\u{2012}", "\u{2015}", "–", "-",
            ]
            .iter()
            .any(|c| {
                let after = cur.rest().strip_prefix(c).map(|r| r.trim_start());
                after.is_some_and(|r| r.starts_with(|d: char| d.is_ascii_digit()))
            });
            if unknown {
                error =
                    Some("a connector between numbers that is not read: write N–M or N, M and K");
            }
            cur.i = end;
            out.push(Citation {
                line: text[..at].matches('\n').count() + 1,
                text: text[at..cur.i].to_string(),
                facts,
                error,
            });
        }
        out
    }

    /// The entries of a facts document: every line that starts with its number, as `**14.`
    /// (an entry's bold title) or as a third-level heading `### 14.` (section headings, `##`,
    /// carry no number). Each entry's number, in order.
    fn entries(doc: &str) -> Vec<u32> {
        doc.lines()
            .filter_map(|line| {
                let line = line.trim_start();
                let rest = line
                    .strip_prefix("**")
                    .or_else(|| line.strip_prefix("### ").map(str::trim_start))?;
                let digits =
                    rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
                if digits == 0 || !rest[digits..].starts_with('.') {
                    return None;
                }
                rest[..digits].parse().ok()
            })
            .collect()
    }

    /// Every `.rs` file under `dir`, sorted.
    fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
        let mut items: Vec<PathBuf> = fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
            .map(|item| item.expect("a directory entry").path())
            .collect();
        items.sort();
        for path in items {
            if path.is_dir() {
                rust_files(&path, out);
            } else if path.extension().is_some_and(|x| x == "rs") {
                out.push(path);
            }
        }
    }

    /// The fact numbers `text` cites, flattened.
    fn cited(text: &str) -> Vec<u32> {
        citations(text).into_iter().flat_map(|c| c.facts).collect()
    }

    /// Checks every citation in `text` (from `place`) against `known`, adding a line to
    /// `wrong` for each that names a missing entry or cannot be read; how many there are.
    fn check(place: &str, text: &str, known: &BTreeSet<u32>, wrong: &mut Vec<String>) -> usize {
        let all = citations(text);
        for c in &all {
            let missing: Vec<u32> = c
                .facts
                .iter()
                .copied()
                .filter(|n| !known.contains(n))
                .collect();
            if let Some(why) = c.error {
                wrong.push(format!("{place}:{}: `{}`: {why}", c.line, c.text));
            } else if !missing.is_empty() {
                wrong.push(format!(
                    "{place}:{}: `{}` cites {missing:?}, which docs/cuda-facts.md has no entry for",
                    c.line, c.text
                ));
            }
        }
        all.len()
    }

    #[test]
    fn the_citation_parser_reads_every_form_the_code_uses() {
        assert_eq!(cited("relies on fact 27 here"), [27]);
        assert_eq!(cited("facts 39–43"), [39, 40, 41, 42, 43]);
        assert_eq!(cited("facts 26-29 (hyphen)"), [26, 27, 28, 29]);
        assert_eq!(cited("facts 33 – 35"), [33, 34, 35]);
        assert_eq!(cited("facts 14, 15 and 16"), [14, 15, 16]);
        assert_eq!(cited("facts 18, 31, 32)"), [18, 31, 32]);
        assert_eq!(cited("Fact 33 and 34: sticky"), [33, 34]);
        assert_eq!(cited("facts 33–34, (the documentation)"), [33, 34]);
        assert_eq!(cited("facts 33–35, 52"), [33, 34, 35, 52]);
        assert_eq!(cited("(fact 15)"), [15]);
        assert_eq!(cited("/// Fact 14: attribute 110"), [14]);
        assert_eq!(cited("FACTS 1 and 2"), [1, 2]);
        assert_eq!(
            cited("// ---- Facts 40–43: captures. ----"),
            [40, 41, 42, 43]
        );
        assert_eq!(cited("fact 12."), [12]);
        // A citation wrapped across doc-comment lines.
        assert_eq!(cited("as in fact\n    /// 21, and so on"), [21]);
        assert_eq!(cited("facts 14,\n//! 15 and\n/// 16"), [14, 15, 16]);
        // Not citations.
        assert_eq!(cited("the CUDA facts sheet"), [] as [u32; 0]);
        assert_eq!(cited("an artifact 3 and a factor 2"), [] as [u32; 0]);
        assert_eq!(cited("facts: 3"), [] as [u32; 0]);
        assert_eq!(cited("fact 2x"), [] as [u32; 0]);
        assert_eq!(cited("fact\nlet x = 3;"), [] as [u32; 0]);
        // What follows a citation but is not part of it.
        assert_eq!(cited("fact 21 - the unmap"), [21]);
        assert_eq!(cited("fact 27 and a descriptor"), [27]);
        // Several citations, each on its line.
        let all = citations("a\nfact 1 then fact 2\n\nFacts 3–4");
        let at: Vec<(usize, &str)> = all.iter().map(|c| (c.line, c.text.as_str())).collect();
        assert_eq!(at, [(2, "fact 1"), (2, "fact 2"), (4, "Facts 3–4")]);
        // A range that runs backwards is an error, not a silent nothing.
        assert!(citations("facts 43–39")[0].error.is_some());
        // A list wrapped on a plain or block-comment line is read whole.
        assert_eq!(cited("facts 14,\n15 and 16"), [14, 15, 16]);
        assert_eq!(cited("facts 14,\n * 15"), [14, 15]);
        // A connector the parser does not read is an error, never a silently shorter citation.
        for text in [
            "facts 12 to 14",
            "facts 12 through 14",
            "facts 12/14",
            "facts 12 & 13",
            "facts 12\u{2212}14",
            "facts 1–2–99",
        ] {
            assert!(citations(text)[0].error.is_some(), "{text}");
        }
        assert!(
            citations("fact 7, and then")
                .iter()
                .all(|c| c.error.is_none())
        );
    }

    #[test]
    fn the_entry_parser_reads_bold_numbers_and_headings() {
        let doc = "# Title\n\n## 1. A section\n\n**1. First.**\n\n- **Driver** — text, **2.** \
                   inside a line\n**2.** Second.\n### 3. Third\n### 4 no dot\n**x.** no number\n\
                   1. a list item\n**5.** Fifth.\n";
        assert_eq!(entries(doc), [1, 2, 3, 5]);
    }

    #[test]
    fn the_facts_document_numbers_its_entries_once_each_from_1() {
        let numbers = entries(DOC);
        assert!(!numbers.is_empty(), "no entry found in docs/cuda-facts.md");
        let expected: Vec<u32> = (1..=numbers.len() as u32).collect();
        assert_eq!(
            numbers, expected,
            "docs/cuda-facts.md: entries must be numbered 1, 2, 3, … in order, each once \
             (a new fact takes the next number; none is renumbered)"
        );
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "reads the source tree: Miri's isolation has no file system"
    )]
    fn every_fact_cited_in_src_and_tests_is_an_entry_of_the_facts_document() {
        let known: BTreeSet<u32> = entries(DOC).into_iter().collect();
        assert!(!known.is_empty(), "no entry found in docs/cuda-facts.md");

        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        // This file's own examples above cite missing facts on purpose.
        let this_file = root.join(file!());
        let mut files = Vec::new();
        rust_files(&root.join("src"), &mut files);
        rust_files(&root.join("tests"), &mut files);
        rust_files(&root.join("examples"), &mut files);
        rust_files(&root.join("benches"), &mut files);
        files.push(root.join("README.md"));

        let mut wrong = Vec::new();
        let mut in_code = 0;
        for path in &files {
            if *path == this_file {
                continue;
            }
            let text = fs::read_to_string(path)
                .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
            let place = path.strip_prefix(root).unwrap_or(path).display();
            in_code += check(&place.to_string(), &text, &known, &mut wrong);
        }
        // The document's own cross-references, too.
        check("docs/cuda-facts.md", DOC, &known, &mut wrong);

        assert!(
            in_code > 0,
            "no fact citation found in {} files under src/ and tests/: the parser is broken",
            files.len()
        );
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    }
}
