//! Every `rust` block of the README and docs/ is compiled code: a page
//! included as doctests (its blocks compile; `ignore` is refused), the
//! training guide's complete example (tests/parity.rs checks it is
//! examples/training_guide.rs), or an excerpt of a compiled file named by
//! an `<!-- excerpt: PATH -->` line above the block, whose code (comments,
//! white space and commas aside) stands in that file in the same order.
//! A comment line in an excerpt may stand for elided code.

use std::fs;
use std::path::Path;

/// Pages compiled as doctests, and the file whose `include_str!` does it.
const DOCTEST_PAGES: [(&str, &str); 6] = [
    ("README.md", "accel/src/doc_examples.rs"),
    ("docs/zero.md", "accel/src/doc_examples.rs"),
    ("docs/torch.md", "accel/src/doc_examples.rs"),
    ("docs/burn.md", "integrations/burn/src/lib.rs"),
    ("docs/inference.md", "integrations/tch/src/lib.rs"),
    ("docs/candle.md", "integrations/candle/src/lib.rs"),
];

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// One fenced `rust` block: its first line (1-based), the fence's
/// attributes, the excerpt's file if marked, and its text.
struct Block {
    line: usize,
    attrs: String,
    excerpt: Option<String>,
    body: String,
}

fn blocks(text: &str) -> Vec<Block> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let Some(attrs) = lines[i].trim_start().strip_prefix("```rust") else {
            i += 1;
            continue;
        };
        let excerpt = lines[..i]
            .iter()
            .rev()
            .find(|l| !l.trim().is_empty())
            .and_then(|l| l.trim().strip_prefix("<!-- excerpt: "))
            .and_then(|l| l.strip_suffix(" -->"))
            .map(str::to_string);
        let end = (i + 1..lines.len())
            .find(|&k| lines[k].trim() == "```")
            .unwrap_or_else(|| panic!("an unclosed rust block at line {}", i + 1));
        out.push(Block {
            line: i + 1,
            attrs: attrs.trim().to_string(),
            excerpt,
            body: lines[i + 1..end].join("\n"),
        });
        i = end + 1;
    }
    out
}

/// `code` without `//` comments, white space or commas.
fn squeeze(code: &str) -> String {
    code.lines()
        .map(|l| l.find("//").map_or(l, |i| &l[..i]))
        .flat_map(str::chars)
        .filter(|c| !c.is_whitespace() && *c != ',')
        .collect()
}

/// Where `body` is not `source`'s code in order: the first segment (runs
/// of lines between comment lines) missing, if any.
fn missing_segment(body: &str, source: &str) -> Option<String> {
    let source = squeeze(source);
    let mut segments = vec![String::new()];
    for l in body.lines() {
        if l.trim_start().starts_with("//") {
            segments.push(String::new());
        } else {
            let s = segments.last_mut().unwrap();
            s.push_str(l);
            s.push('\n');
        }
    }
    let mut at = 0;
    for seg in segments {
        let s = squeeze(&seg);
        if s.is_empty() {
            continue;
        }
        match source[at..].find(&s) {
            Some(i) => at += i + s.len(),
            None => return Some(seg),
        }
    }
    None
}

fn pages() -> Vec<String> {
    let mut pages = vec!["README.md".to_string()];
    for e in fs::read_dir(root().join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            pages.push(format!("docs/{}", p.file_name().unwrap().to_string_lossy()));
        }
    }
    pages.sort();
    pages
}

#[test]
fn every_rust_block_of_the_docs_is_compiled_code() {
    let mut wrong = Vec::new();
    for (page, includer) in DOCTEST_PAGES {
        let text = fs::read_to_string(root().join(includer)).unwrap();
        let name = page.rsplit('/').next().unwrap();
        assert!(
            text.contains("include_str!") && text.contains(name),
            "{includer} no longer includes {page} as doctests"
        );
    }
    let mut excerpts = 0;
    for page in pages() {
        let text = fs::read_to_string(root().join(&page)).unwrap();
        let doctests = DOCTEST_PAGES.iter().any(|(p, _)| *p == page);
        for (i, b) in blocks(&text).into_iter().enumerate() {
            let at = format!("{page}:{}", b.line);
            if b.attrs.contains("ignore") {
                wrong.push(format!("{at}: `rust,ignore` is compiled nowhere"));
            } else if let Some(file) = &b.excerpt {
                excerpts += 1;
                match fs::read_to_string(root().join(file)) {
                    Err(e) => wrong.push(format!("{at}: excerpt of {file}: {e}")),
                    Ok(source) => {
                        if let Some(seg) = missing_segment(&b.body, &source) {
                            wrong.push(format!("{at}: not in {file}:\n{seg}"));
                        }
                    }
                }
            } else if !(doctests || (page == "docs/training.md" && i == 0)) {
                wrong.push(format!(
                    "{at}: neither on a doctest page nor marked <!-- excerpt: PATH -->"
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert!(excerpts >= 10, "{excerpts} excerpts found");
}

#[test]
fn an_excerpt_that_drifted_from_its_file_is_found() {
    let source = "fn a() -> u32 {\n    // why\n    1 + 2\n}\n\nfn b() {}\n";
    assert_eq!(missing_segment("fn a() -> u32 { 1 + 2 }", source), None);
    assert_eq!(
        missing_segment("fn a() -> u32 {\n// ...\n}\nfn b() {}", source),
        None
    );
    assert!(missing_segment("fn a() -> u32 { 1 + 3 }", source).is_some());
    // Out of order is not an excerpt.
    assert!(missing_segment("fn b() {}\n// ...\nfn a()", source).is_some());
}
