//! Worker output: each stdout/stderr pipe is read on its own thread, split
//! into lines, and every whole line is written with its `[rank N] ` prefix
//! in one call under one lock, so lines of different ranks never mix.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

/// Lines of a worker's stderr kept for the failure report.
pub const TAIL_LINES: usize = 20;
/// A "line" longer than this is written out in pieces (a progress bar
/// without newlines must not grow the buffer forever).
const MAX_LINE: usize = 64 * 1024;

static TERMINAL: Mutex<()> = Mutex::new(());

/// Which of the launcher's streams a pipe goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// The worker's stdout, to the launcher's stdout.
    Stdout,
    /// The worker's stderr, to the launcher's stderr.
    Stderr,
}

/// Write one line of the launcher's own (`accel: ...`) to stderr, under the
/// same lock as worker lines.
pub fn say(line: &str) {
    let _g = TERMINAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "accel: {line}");
}

/// Write a block of lines to stderr at once, each prefixed `accel: `.
pub fn say_block(lines: &[String]) {
    let _g = TERMINAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut buf = String::new();
    for l in lines {
        buf.push_str("accel: ");
        buf.push_str(l);
        buf.push('\n');
    }
    let _ = std::io::stderr().lock().write_all(buf.as_bytes());
}

/// Write a line to stdout under the terminal lock (the JSON summary).
pub fn print_stdout(line: &str) {
    let _g = TERMINAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// What the pumps of one worker share: the log file, the stderr tail and the
/// time of its last output.
#[derive(Debug)]
pub struct RankSink {
    rank: usize,
    show: bool,
    tee: Option<Mutex<File>>,
    tail: Mutex<VecDeque<String>>,
    start: Instant,
    last_output_ms: AtomicU64,
}

impl RankSink {
    /// A sink for `rank`; `show` = write to the terminal; `tee` = also append
    /// raw lines to this file.
    pub fn new(rank: usize, show: bool, tee: Option<File>, start: Instant) -> Arc<RankSink> {
        Arc::new(RankSink {
            rank,
            show,
            tee: tee.map(Mutex::new),
            tail: Mutex::new(VecDeque::with_capacity(TAIL_LINES)),
            start,
            last_output_ms: AtomicU64::new(start.elapsed().as_millis() as u64),
        })
    }

    /// The last [`TAIL_LINES`] lines the worker wrote to stderr.
    pub fn tail(&self) -> Vec<String> {
        self.tail
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    /// When the worker last wrote a line (or was started).
    pub fn last_output(&self) -> Instant {
        self.start + std::time::Duration::from_millis(self.last_output_ms.load(Ordering::Relaxed))
    }

    /// Note that the worker is alive (e.g. just spawned).
    pub fn touch(&self) {
        self.last_output_ms
            .store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// Handle one whole line of the worker (without its newline): prefix
    /// and show it, tee it, keep it in the stderr tail. The MPI path calls
    /// it for lines mpirun tagged with this rank.
    pub fn line(&self, stream: Stream, line: &[u8]) {
        self.touch();
        if let Some(f) = &self.tee {
            let mut f = f.lock().unwrap_or_else(|p| p.into_inner());
            let _ = f.write_all(line);
            let _ = f.write_all(b"\n");
        }
        if stream == Stream::Stderr {
            let mut t = self.tail.lock().unwrap_or_else(|p| p.into_inner());
            if t.len() == TAIL_LINES {
                t.pop_front();
            }
            t.push_back(String::from_utf8_lossy(line).into_owned());
        }
        if self.show {
            let mut buf = Vec::with_capacity(line.len() + 16);
            buf.extend_from_slice(format!("[rank {}] ", self.rank).as_bytes());
            buf.extend_from_slice(line);
            buf.push(b'\n');
            let _g = TERMINAL.lock().unwrap_or_else(|p| p.into_inner());
            // A closed terminal (`| head`) must not stop the draining: the
            // worker would block on a full pipe.
            match stream {
                Stream::Stdout => {
                    let mut o = std::io::stdout().lock();
                    let _ = o.write_all(&buf);
                    let _ = o.flush();
                }
                Stream::Stderr => {
                    let _ = std::io::stderr().lock().write_all(&buf);
                }
            }
        }
    }

    /// Write a marker line into the log file only.
    pub fn tee_marker(&self, text: &str) {
        if let Some(f) = &self.tee {
            let mut f = f.lock().unwrap_or_else(|p| p.into_inner());
            let _ = writeln!(f, "{text}");
        }
    }
}

/// Read `pipe` to its end on a new thread, handing each line to `sink`.
pub fn pump(
    pipe: impl Read + Send + 'static,
    stream: Stream,
    sink: Arc<RankSink>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("accel-out-{}", sink.rank))
        .spawn(move || {
            let mut r = BufReader::with_capacity(16 * 1024, pipe);
            let mut line = Vec::with_capacity(256);
            loop {
                line.clear();
                // Read up to a newline, but at most MAX_LINE bytes.
                let n = match (&mut r).take(MAX_LINE as u64).read_until(b'\n', &mut line) {
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(_) => break,
                };
                if n == 0 {
                    break;
                }
                if line.last() == Some(&b'\n') {
                    line.pop();
                    if line.last() == Some(&b'\r') {
                        line.pop();
                    }
                }
                sink.line(stream, &line);
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_last_stderr_lines_and_tees_everything() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rank-3.log");
        let sink = RankSink::new(3, false, Some(File::create(&path).unwrap()), Instant::now());
        let text: String = (0..30).map(|i| format!("line {i}\n")).collect();
        pump(
            std::io::Cursor::new(text + "partial"),
            Stream::Stderr,
            sink.clone(),
        )
        .unwrap()
        .join()
        .unwrap();
        let tail = sink.tail();
        assert_eq!(tail.len(), TAIL_LINES);
        assert_eq!(tail.first().unwrap(), "line 11");
        assert_eq!(tail.last().unwrap(), "partial");
        let logged = std::fs::read_to_string(&path).unwrap();
        assert_eq!(logged.lines().count(), 31);
        assert!(logged.ends_with("partial\n"));
    }
}
