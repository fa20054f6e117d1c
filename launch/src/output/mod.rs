//! Worker output: each stdout/stderr pipe is read on its own thread, split
//! into lines, and every whole line is written with its `[rank N] ` prefix
//! in one call under one lock, so lines of different ranks never mix.
//! mpirun's rank-tagged lines are split by [`tags`].

pub mod tags;

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use accel_api::{Error, Result};

use tags::{split_tagged, Piece};

/// The global ranks whose output is shown (`--ranks 0,2-3`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankFilter(pub BTreeSet<usize>);

impl RankFilter {
    /// `true` when `rank`'s output is shown.
    pub fn shows(&self, rank: usize) -> bool {
        self.0.contains(&rank)
    }
}

impl FromStr for RankFilter {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<RankFilter, String> {
        let mut set = BTreeSet::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let bad = || format!("`{part}` is not a rank or a range of ranks like 2-5");
            match part.split_once('-') {
                Some((a, b)) => {
                    let a: usize = a.trim().parse().map_err(|_| bad())?;
                    let b: usize = b.trim().parse().map_err(|_| bad())?;
                    if a > b {
                        return Err(format!("range `{part}` is empty"));
                    }
                    if b - a > 1 << 20 {
                        return Err(format!("range `{part}` is too large"));
                    }
                    set.extend(a..=b);
                }
                None => {
                    set.insert(part.parse().map_err(|_| bad())?);
                }
            }
        }
        if set.is_empty() {
            return Err("name at least one rank, e.g. 0 or 0,2-3".into());
        }
        Ok(RankFilter(set))
    }
}

impl fmt::Display for RankFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v: Vec<String> = self.0.iter().map(|r| r.to_string()).collect();
        f.write_str(&v.join(","))
    }
}

/// torchrun's stream selector (`--tee`, `--redirects`): `0` none, `1`
/// stdout, `2` stderr, `3` both, for every local rank, or per local rank as
/// `0:3,1:1` (ranks not named: none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StdStreams {
    /// The same streams for every local rank (bit 1 stdout, bit 2 stderr).
    All(u8),
    /// Streams per local rank.
    PerRank(std::collections::BTreeMap<usize, u8>),
}

impl StdStreams {
    /// The streams of `local_rank` (bit 1 stdout, bit 2 stderr).
    pub fn of(&self, local_rank: usize) -> u8 {
        match self {
            StdStreams::All(v) => *v,
            StdStreams::PerRank(m) => m.get(&local_rank).copied().unwrap_or(0),
        }
    }

    /// `true` when `s` has torchrun's form (`0`-`3` or `N:V,...`), which is
    /// how `--tee` tells torchrun's selector from accel's directory.
    pub fn looks_like(s: &str) -> bool {
        s.parse::<StdStreams>().is_ok()
    }
}

impl FromStr for StdStreams {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<StdStreams, String> {
        let value = |v: &str| match v.trim() {
            "0" => Ok(0u8),
            "1" => Ok(1),
            "2" => Ok(2),
            "3" => Ok(3),
            other => Err(format!(
                "`{other}` is not a stream selector: 0 none, 1 stdout, 2 stderr, 3 both"
            )),
        };
        let s = s.trim();
        if !s.contains(':') {
            return value(s).map(StdStreams::All);
        }
        let mut m = std::collections::BTreeMap::new();
        for part in s.split(',') {
            let (r, v) = part
                .split_once(':')
                .ok_or_else(|| format!("`{part}` is not LOCAL_RANK:STREAMS, e.g. 0:3"))?;
            let r: usize = r
                .trim()
                .parse()
                .map_err(|_| format!("`{r}` in `{part}` is not a local rank"))?;
            m.insert(r, value(v)?);
        }
        Ok(StdStreams::PerRank(m))
    }
}

/// torchrun's per-stream log files (`--tee` and `--redirects` with
/// `--log-dir`): `DIR/attempt_N/LOCAL_RANK/stdout.log` and `stderr.log`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamLogs {
    /// The run's log directory (torchrun's `<log_dir>/<run_id>_<random>`).
    pub dir: std::path::PathBuf,
    /// Streams written to the files and shown (`--tee`).
    pub tee: StdStreams,
    /// Streams written to the files and not shown (`--redirects`; `--tee`
    /// wins where both name a stream).
    pub redirects: StdStreams,
}

impl StreamLogs {
    /// The files of `local_rank` in `attempt` (stdout's, stderr's; `None`
    /// for a stream not logged), and which streams are hidden.
    ///
    /// # Errors
    /// [`accel_api::ErrorKind::Io`] naming the directory or file.
    pub fn open(&self, local_rank: usize, attempt: u32) -> Result<([Option<File>; 2], [bool; 2])> {
        let (tee, redir) = (self.tee.of(local_rank), self.redirects.of(local_rank));
        let dir = self
            .dir
            .join(format!("attempt_{attempt}"))
            .join(local_rank.to_string());
        let mut files = [None, None];
        let mut hidden = [false, false];
        for (i, (bit, name)) in [(1u8, "stdout.log"), (2, "stderr.log")].iter().enumerate() {
            if (tee | redir) & bit == 0 {
                continue;
            }
            hidden[i] = tee & bit == 0;
            std::fs::create_dir_all(&dir).map_err(|e| {
                Error::io(
                    format!("cannot create the log directory {}", dir.display()),
                    e,
                )
            })?;
            let path = dir.join(name);
            files[i] = Some(File::create(&path).map_err(|e| {
                Error::io(format!("cannot open the log file {}", path.display()), e)
            })?);
        }
        Ok((files, hidden))
    }
}

/// Open (attempt 0: truncate; later: append) the `--tee` file of `rank`.
///
/// # Errors
/// [`accel_api::ErrorKind::Io`] naming the directory or file.
pub fn open_log(dir: &Path, rank: usize, attempt: u32) -> Result<File> {
    std::fs::create_dir_all(dir).map_err(|e| {
        Error::io(
            format!("cannot create the log directory {}", dir.display()),
            e,
        )
    })?;
    let path = dir.join(format!("rank-{rank}.log"));
    let mut o = OpenOptions::new();
    o.create(true);
    if attempt == 0 {
        o.write(true).truncate(true);
    } else {
        o.append(true);
    }
    o.open(&path)
        .map_err(|e| Error::io(format!("cannot open the log file {}", path.display()), e))
}

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
    stdout_to_stderr: bool,
    /// torchrun's per-stream files (stdout's, stderr's).
    streams: [Option<Mutex<File>>; 2],
    /// Streams written to their file only (torchrun's `--redirects`).
    hidden: [bool; 2],
}

impl RankSink {
    /// A sink for `rank`; `show` = write to the terminal; `tee` = also append
    /// raw lines to this file.
    pub fn new(rank: usize, show: bool, tee: Option<File>, start: Instant) -> Arc<RankSink> {
        RankSink::with_streams(rank, show, tee, start, false)
    }

    /// [`new`](Self::new); `stdout_to_stderr`: show the worker's stdout
    /// lines on the launcher's stderr (stdout is the caller's result).
    pub fn with_streams(
        rank: usize,
        show: bool,
        tee: Option<File>,
        start: Instant,
        stdout_to_stderr: bool,
    ) -> Arc<RankSink> {
        Arc::new(RankSink {
            stdout_to_stderr,
            rank,
            show,
            tee: tee.map(Mutex::new),
            tail: Mutex::new(VecDeque::with_capacity(TAIL_LINES)),
            start,
            last_output_ms: AtomicU64::new(start.elapsed().as_millis() as u64),
            streams: [None, None],
            hidden: [false, false],
        })
    }

    /// [`with_streams`](Self::with_streams), also writing the streams that
    /// `files` name to them (torchrun's stdout.log and stderr.log), and
    /// showing a `hidden` stream nowhere else.
    pub fn with_stream_files(
        rank: usize,
        show: bool,
        tee: Option<File>,
        start: Instant,
        stdout_to_stderr: bool,
        (files, hidden): ([Option<File>; 2], [bool; 2]),
    ) -> Arc<RankSink> {
        let mut sink = Arc::into_inner(RankSink::with_streams(
            rank,
            show,
            tee,
            start,
            stdout_to_stderr,
        ))
        .expect("a new sink has no other owner");
        sink.streams = files.map(|f| f.map(Mutex::new));
        sink.hidden = hidden;
        Arc::new(sink)
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
    /// and show it, tee it, keep it in the stderr tail. [`MpirunOutput`]
    /// calls it for lines mpirun tagged with this rank.
    pub fn line(&self, stream: Stream, line: &[u8]) {
        self.touch();
        if let Some(f) = &self.tee {
            let mut f = f.lock().unwrap_or_else(|p| p.into_inner());
            let _ = f.write_all(line);
            let _ = f.write_all(b"\n");
        }
        let i = usize::from(stream == Stream::Stderr);
        if let Some(f) = &self.streams[i] {
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
        if self.show && !self.hidden[i] {
            let mut buf = Vec::with_capacity(line.len() + 16);
            buf.extend_from_slice(format!("[rank {}] ", self.rank).as_bytes());
            buf.extend_from_slice(line);
            buf.push(b'\n');
            let _g = TERMINAL.lock().unwrap_or_else(|p| p.into_inner());
            // A closed terminal (`| head`) must not stop the draining: the
            // worker would block on a full pipe.
            match stream {
                Stream::Stdout if !self.stdout_to_stderr => {
                    let mut o = std::io::stdout().lock();
                    let _ = o.write_all(&buf);
                    let _ = o.flush();
                }
                Stream::Stdout | Stream::Stderr => {
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
///
/// # Errors
/// The thread could not be started.
pub fn pump(
    pipe: impl Read + Send + 'static,
    stream: Stream,
    sink: Arc<RankSink>,
) -> std::io::Result<JoinHandle<()>> {
    let name = format!("accel-out-{}", sink.rank);
    pump_lines(pipe, name, move |line| sink.line(stream, line))
}

/// Read `pipe` to its end on a new thread named `name`, handing each whole
/// line (without its newline; at most 64 KiB at a time) to `on_line`.
///
/// # Errors
/// The thread could not be started.
pub fn pump_lines(
    pipe: impl Read + Send + 'static,
    name: String,
    mut on_line: impl FnMut(&[u8]) + Send + 'static,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new().name(name).spawn(move || {
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
            on_line(&line);
        }
    })
}

/// mpirun's own lines kept for the root-cause block.
const MPIRUN_LINES: usize = 40;

/// The output of one mpirun: its tagged lines go to the ranks' sinks
/// (partial lines of a rank are joined first), its own lines to stderr as
/// `[mpirun] ...`, and the last of those are kept for the root cause.
#[derive(Debug)]
pub struct MpirunOutput {
    sinks: Vec<Arc<RankSink>>,
    echo: bool,
    pending: Mutex<HashMap<(usize, bool), Vec<u8>>>,
    own: Mutex<VecDeque<String>>,
}

impl MpirunOutput {
    /// Demultiplex into `sinks` (index = rank); `echo`: show mpirun's own
    /// lines on stderr.
    pub fn new(sinks: Vec<Arc<RankSink>>, echo: bool) -> Arc<MpirunOutput> {
        Arc::new(MpirunOutput {
            sinks,
            echo,
            pending: Mutex::new(HashMap::new()),
            own: Mutex::new(VecDeque::new()),
        })
    }

    /// Handle one line of mpirun's stdout or stderr.
    pub fn line(&self, raw: &[u8]) {
        let text = String::from_utf8_lossy(raw);
        for piece in split_tagged(&text) {
            match piece {
                Piece::Rank {
                    rank,
                    stderr,
                    text,
                    complete,
                } if rank < self.sinks.len() => {
                    let stream = if stderr {
                        Stream::Stderr
                    } else {
                        Stream::Stdout
                    };
                    let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
                    let buf = pending.entry((rank, stderr)).or_default();
                    buf.extend_from_slice(text.as_bytes());
                    if complete || buf.len() >= MAX_LINE {
                        let whole = std::mem::take(buf);
                        drop(pending);
                        self.sinks[rank].line(stream, &whole);
                    }
                }
                Piece::Rank { text, .. } | Piece::Untagged(text) => self.own_line(text),
            }
        }
    }

    fn own_line(&self, text: &str) {
        if text.is_empty() {
            return;
        }
        if self.echo {
            let _g = TERMINAL.lock().unwrap_or_else(|p| p.into_inner());
            let _ = writeln!(std::io::stderr().lock(), "[mpirun] {text}");
        }
        let mut kept = self.own.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() == MPIRUN_LINES {
            kept.pop_front();
        }
        kept.push_back(text.to_string());
    }

    /// Partial lines still waiting for their newline go out as they are
    /// (the rank ended without one).
    pub fn flush(&self) {
        let rest: Vec<((usize, bool), Vec<u8>)> = self
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
            .filter(|(_, v)| !v.is_empty())
            .collect();
        for ((rank, stderr), text) in rest {
            let stream = if stderr {
                Stream::Stderr
            } else {
                Stream::Stdout
            };
            self.sinks[rank].line(stream, &text);
        }
    }

    /// mpirun's last own lines.
    pub fn own_lines(&self) -> Vec<String> {
        self.own
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_filter_parses_lists_and_ranges() {
        let f: RankFilter = "0, 2-4,7".parse().unwrap();
        assert_eq!(f.0.iter().copied().collect::<Vec<_>>(), vec![0, 2, 3, 4, 7]);
        assert_eq!(f.to_string(), "0,2,3,4,7");
        assert!("3-1".parse::<RankFilter>().unwrap_err().contains("empty"));
        assert!("x".parse::<RankFilter>().unwrap_err().contains("`x`"));
        assert!("".parse::<RankFilter>().is_err());
    }

    #[test]
    fn torchruns_stream_selectors_parse_and_name_what_is_wrong() {
        assert_eq!("3".parse(), Ok(StdStreams::All(3)));
        let m: StdStreams = "0:1, 1:2".parse().unwrap();
        assert_eq!((m.of(0), m.of(1), m.of(2)), (1, 2, 0));
        assert!("4".parse::<StdStreams>().unwrap_err().contains("0 none"));
        assert!("0:1,x".parse::<StdStreams>().unwrap_err().contains("`x`"));
        assert!("a:1"
            .parse::<StdStreams>()
            .unwrap_err()
            .contains("local rank"));
        assert!(StdStreams::looks_like("0:3") && !StdStreams::looks_like("logs"));
    }

    #[test]
    fn stream_files_get_their_stream_and_redirected_streams_are_hidden() {
        let dir = tempfile::tempdir().unwrap();
        let logs = StreamLogs {
            dir: dir.path().to_path_buf(),
            tee: StdStreams::All(1),
            redirects: StdStreams::PerRank([(0, 2)].into_iter().collect()),
        };
        let opened = logs.open(0, 1).unwrap();
        assert_eq!(opened.1, [false, true], "stdout teed, stderr redirected");
        let sink = RankSink::with_stream_files(0, false, None, Instant::now(), false, opened);
        sink.line(Stream::Stdout, b"out");
        sink.line(Stream::Stderr, b"err");
        let read = |f: &str| std::fs::read_to_string(dir.path().join("attempt_1/0").join(f));
        assert_eq!(read("stdout.log").unwrap(), "out\n");
        assert_eq!(read("stderr.log").unwrap(), "err\n");
        // Local rank 1: only stdout is logged.
        let (files, hidden) = logs.open(1, 1).unwrap();
        assert!(files[0].is_some() && files[1].is_none() && hidden == [false, false]);
    }

    #[test]
    fn mpirun_pieces_are_joined_per_rank_and_stream() {
        let sinks: Vec<_> = (0..2)
            .map(|r| RankSink::new(r, false, None, Instant::now()))
            .collect();
        let out = MpirunOutput::new(sinks.clone(), false);
        out.line(b"[1,0]<stdout>:part1 [1,1]<stdout>:part1 [1,0]<stderr>:x");
        out.line(b"[1,0]<stderr>:y[1,0]<stdout>:part2");
        out.line(b"  Process name: [[26941,1],0]");
        out.line(b"[1,0]<stderr>:z");
        out.line(b"[1,1]<stderr>:tail without newline");
        out.flush();
        assert_eq!(sinks[0].tail(), vec!["x", "yz"]);
        assert_eq!(sinks[1].tail(), vec!["tail without newline"]);
        assert_eq!(out.own_lines(), vec!["  Process name: [[26941,1],0]"]);
    }

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
