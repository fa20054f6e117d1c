//! The output of rank threads: lines that carry their rank (tagged for
//! the launcher under `accel launch`, prefixed `[rank N] ` under
//! [`Threads`](crate::Threads)), and the panic hook's report on a rank
//! thread. A leaf below `threads` and the panic hook: it reads only the
//! calling thread's rank state.

use std::fmt;
use std::io::Write;

use accel_api::worker::tag_line;

use crate::state;

/// Write `args` and a newline to stdout (`stderr`: to stderr) as the
/// calling rank thread's output: tagged under `accel launch`, prefixed
/// `[rank N] ` under [`Threads`](crate::Threads), as is elsewhere. One write per call, so
/// lines of different ranks do not interleave. What [`rank_println!`](crate::rank_println)
/// expands to.
pub fn print_rank_line(stderr: bool, args: fmt::Arguments<'_>) {
    let text = args.to_string();
    let mut out = String::with_capacity(text.len() + 16);
    match state::current_rank_thread() {
        Some(rt) => {
            for line in text.split('\n') {
                if rt.tagged {
                    out.push_str(&tag_line(rt.state.rank, line));
                } else {
                    out.push_str(&format!("[rank {}] {line}", rt.state.rank));
                }
                out.push('\n');
            }
        }
        None => {
            out.push_str(&text);
            out.push('\n');
        }
    }
    // A closed stream is the reader's choice; nothing to report.
    let _ = if stderr {
        std::io::stderr().lock().write_all(out.as_bytes())
    } else {
        std::io::stdout().lock().write_all(out.as_bytes())
    };
}

/// The panic hook's part on a tagged rank thread (under `accel launch`):
/// write the panic's place and message with the rank's tag, so that the
/// launcher shows them under that rank and in its root cause. `false`
/// elsewhere, or when `RUST_BACKTRACE` asks for the default hook's report.
pub(crate) fn report_rank_thread_panic(info: &std::panic::PanicHookInfo<'_>) -> bool {
    let tagged = state::current_rank_thread().is_some_and(|rt| rt.tagged);
    let backtrace = std::env::var_os("RUST_BACKTRACE").is_some_and(|v| v != "0");
    if !tagged || backtrace {
        return false;
    }
    let name = std::thread::current()
        .name()
        .map(str::to_string)
        .unwrap_or_else(|| "?".into());
    let place = info
        .location()
        .map(|l| format!(" at {}:{}:{}", l.file(), l.line(), l.column()))
        .unwrap_or_default();
    print_rank_line(
        true,
        format_args!(
            "thread '{name}' panicked{place}:\n{}",
            panic_message(info.payload())
        ),
    );
    true
}

pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with a non-string payload".into())
}
