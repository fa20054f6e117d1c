//! Reading mpirun's rank-tagged output: Open MPI's `--tag-output`
//! (`[1,R]<stdout>:text`, one tag per write) and hydra's `-prepend-rank`
//! (`[R] text`, one per line). Next to its main user, the output router
//! (`output/mod.rs`), and a leaf: mpirun's report reader (`mpirun.rs`) and
//! the root-cause block (`supervise`) strip tags through it too.

/// Split a line tagged by the launcher into `(rank, line)`: Open MPI's
/// `--tag-output` form `[1,3]<stdout>:text` and hydra's `-prepend-rank`
/// form `[3] text`. `None` for an untagged line (the launcher's own
/// messages).
pub fn parse_tagged_line(line: &str) -> Option<(usize, &str)> {
    let rest = line.strip_prefix('[')?;
    let (inside, after) = rest.split_once(']')?;
    let rank = match inside.split_once(',') {
        Some((_job, r)) => r.trim().parse().ok()?,
        None => inside.trim().parse().ok()?,
    };
    let text = match after.strip_prefix('<') {
        Some(tagged) => {
            let (stream, text) = tagged.split_once(">:")?;
            if !matches!(stream, "stdout" | "stderr" | "stddiag") {
                return None;
            }
            text
        }
        None => after.strip_prefix(' ').unwrap_or(after),
    };
    Some((rank, text))
}

/// One piece of a line of mpirun's tagged output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Piece<'a> {
    /// Text of mpirun itself (no tag).
    Untagged(&'a str),
    /// Text a rank wrote to `stderr` (`true`) or stdout; `complete` when the
    /// line's newline ends it (otherwise the rank wrote a partial line and
    /// more of it follows later).
    Rank {
        /// The rank.
        rank: usize,
        /// From the rank's stderr.
        stderr: bool,
        /// The text.
        text: &'a str,
        /// The newline ended this piece.
        complete: bool,
    },
}

/// Where an Open MPI `[J,R]<stream>:` tag starts in `s`, with its rank,
/// stream and length.
fn find_tag(s: &str) -> Option<(usize, usize, bool, usize)> {
    let b = s.as_bytes();
    let mut from = 0;
    while let Some(off) = s[from..].find('[') {
        let at = from + off;
        let rest = &s[at + 1..];
        let parsed = (|| {
            let (inside, after) = rest.split_once(']')?;
            let (job, rank) = inside.split_once(',')?;
            if job.is_empty()
                || rank.is_empty()
                || !job.bytes().all(|c| c.is_ascii_digit())
                || !rank.bytes().all(|c| c.is_ascii_digit())
            {
                return None;
            }
            let after = after.strip_prefix('<')?;
            let (stream, _) = after.split_once(">:")?;
            let stderr = match stream {
                "stdout" => false,
                "stderr" | "stddiag" => true,
                _ => return None,
            };
            let len = 1 + inside.len() + 1 + 1 + stream.len() + 2;
            Some((rank.parse().ok()?, stderr, len))
        })();
        if let Some((rank, stderr, len)) = parsed {
            return Some((at, rank, stderr, len));
        }
        from = at + 1;
        if from >= b.len() {
            break;
        }
    }
    None
}

/// Split one line of mpirun's `--tag-output` output into its pieces.
/// Open MPI tags each *write* of a rank, not each line, so one line can
/// hold partial lines of several ranks:
/// `[1,0]<stdout>:part [1,1]<stdout>:part [1,0]<stderr>:x` is three pieces,
/// of which only the last ends a line. Hydra's `[R] text` form is one
/// piece per line.
pub fn split_tagged(line: &str) -> Vec<Piece<'_>> {
    let mut out = Vec::new();
    let Some((first, ..)) = find_tag(line) else {
        // Hydra's per-line form, or mpirun's own line.
        return match parse_tagged_line(line) {
            Some((rank, text)) => vec![Piece::Rank {
                rank,
                stderr: false,
                text,
                complete: true,
            }],
            None => vec![Piece::Untagged(line)],
        };
    };
    if first > 0 {
        out.push(Piece::Untagged(&line[..first]));
    }
    let mut rest = &line[first..];
    while let Some((at, rank, stderr, len)) = find_tag(rest) {
        debug_assert_eq!(at, 0);
        let body = &rest[at + len..];
        let (text, next) = match find_tag(body) {
            Some((n, ..)) => (&body[..n], &body[n..]),
            None => (body, ""),
        };
        out.push(Piece::Rank {
            rank,
            stderr,
            text,
            complete: next.is_empty(),
        });
        if next.is_empty() {
            break;
        }
        rest = next;
    }
    out
}

/// Remove a leading rank tag (`[1,1]<stderr>:`, `[1] `) from a line of
/// mpirun's own report, so that the root-cause block shows the words only.
pub fn untag(line: &str) -> &str {
    parse_tagged_line(line).map_or(line, |(_, text)| text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tagged_lines() {
        assert_eq!(
            parse_tagged_line("[1,3]<stdout>:hello: world"),
            Some((3, "hello: world"))
        );
        assert_eq!(parse_tagged_line("[2] hi"), Some((2, "hi")));
        assert_eq!(parse_tagged_line("mpirun noticed"), None);
        // Open MPI 5 puts a space after the tag; it is part of the text.
        assert_eq!(parse_tagged_line("[1,0]<stderr>: x"), Some((0, " x")));
        assert_eq!(parse_tagged_line("[1,0]<bogus>:x"), None);
        assert_eq!(
            untag("[1,1]<stderr>:MPI_ABORT was invoked"),
            "MPI_ABORT was invoked"
        );
    }

    #[test]
    fn interleaved_partial_writes_split_into_pieces() {
        let p = split_tagged("[1,0]<stdout>:part1 [1,1]<stdout>:part1 [1,0]<stderr>:x");
        assert_eq!(
            p,
            vec![
                Piece::Rank {
                    rank: 0,
                    stderr: false,
                    text: "part1 ",
                    complete: false
                },
                Piece::Rank {
                    rank: 1,
                    stderr: false,
                    text: "part1 ",
                    complete: false
                },
                Piece::Rank {
                    rank: 0,
                    stderr: true,
                    text: "x",
                    complete: true
                },
            ]
        );
        assert_eq!(
            split_tagged("mpirun noticed"),
            vec![Piece::Untagged("mpirun noticed")]
        );
        assert_eq!(
            split_tagged("[3] hi"),
            vec![Piece::Rank {
                rank: 3,
                stderr: false,
                text: "hi",
                complete: true
            }]
        );
        // A bracket in the text is text.
        assert_eq!(
            split_tagged("[1,2]<stdout>:a [b] [1,x]<stdout>:c"),
            vec![Piece::Rank {
                rank: 2,
                stderr: false,
                text: "a [b] [1,x]<stdout>:c",
                complete: true
            }]
        );
    }
}
