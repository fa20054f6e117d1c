//! The parsers of the contract's values (counts, flags, durations) and the
//! bounds of the one timeout: what the launcher's flags, the worker's
//! environment and the runtime read alike.

use std::time::Duration;

use crate::{Error, Result};

/// The shortest `ACCEL_TIMEOUT` accel takes: shorter ones are refused.
pub const MIN_TIMEOUT: Duration = Duration::from_millis(1);

/// Default bound for every blocking call when `ACCEL_TIMEOUT` is not set.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The longest timeout accel accepts (`ACCEL_TIMEOUT`, `--timeout`): 365
/// days. Longer values are an error naming the variable, not a panic and
/// not a silent clamp (docs/adr/0008-launch-library.md).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(365 * 24 * 3600);

const DURATION_FIX: &str = "use e.g. 300, 30s, 500ms, 5m or 1h (at most 365 days)";

/// Parse a count or index: ASCII digits only, read as decimal. Surrounding
/// whitespace is ignored and leading zeros are accepted (`007` is 7, never
/// octal); `+1`, `-1`, `1e3` and `0x10` are refused.
///
/// # Errors
/// [`crate::ErrorKind::InvalidConfig`] naming `name` and the value.
pub fn parse_number<T: std::str::FromStr>(name: &str, v: &str) -> Result<T> {
    let t = v.trim();
    if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
        return Err(Error::invalid_config(
            name,
            v,
            "not a non-negative integer (decimal digits only; surrounding spaces are ignored \
             and leading zeros read as decimal, so ` 007 ` is 7)",
        )
        .with_fix(format!("set {name} to a number such as 0, or unset it")));
    }
    t.parse::<T>().map_err(|_| {
        Error::invalid_config(name, v, "out of range")
            .with_fix(format!("set {name} to a smaller number, or unset it"))
    })
}

/// Parse a gradient accumulation step count: a whole number, at least 1.
///
/// # Errors
/// [`crate::ErrorKind::InvalidConfig`] naming `name` and the value.
pub fn parse_accumulation_steps(name: &str, v: &str) -> Result<usize> {
    match parse_number::<usize>(name, v)? {
        0 => Err(
            Error::invalid_config(name, v, "gradients accumulate over at least 1 step")
                .with_fix(format!("set {name} to 1 (no accumulation) or more")),
        ),
        n => Ok(n),
    }
}

/// Parse a boolean: `1/0`, `true/false`, `yes/no`, `on/off` (empty = off).
///
/// # Errors
/// [`crate::ErrorKind::InvalidConfig`] naming `name`.
pub fn parse_flag(name: &str, v: &str) -> Result<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "" | "0" | "false" | "no" | "off" => Ok(false),
        "1" | "true" | "yes" | "on" => Ok(true),
        _ => Err(Error::invalid_config(name, v, "not a boolean")
            .with_fix(format!("set {name} to 1 or 0"))),
    }
}

/// Parse `30`, `30s`, `1.5s`, `500ms`, `5m`, `1h` (a bare number is
/// seconds), exactly (no floating point), and at most [`MAX_TIMEOUT`].
///
/// # Errors
/// [`crate::ErrorKind::InvalidConfig`] naming `name`: not a duration,
/// an unknown unit, zero, or above [`MAX_TIMEOUT`].
pub fn parse_duration(name: &str, v: &str) -> Result<Duration> {
    let t = v.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = (&t[..split], t[split..].trim());
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    let well_formed = !int.is_empty() || !frac.is_empty();
    if !well_formed || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return Err(Error::invalid_config(name, v, "not a duration").with_fix(DURATION_FIX));
    }
    let nanos_per: u128 = match unit {
        "ns" => 1,
        "us" => 1_000,
        "ms" => 1_000_000,
        "s" | "" => 1_000_000_000,
        "m" | "min" => 60_000_000_000,
        "h" => 3_600_000_000_000,
        "d" => 86_400_000_000_000,
        _ => {
            return Err(
                Error::invalid_config(name, v, "unknown duration unit").with_fix(DURATION_FIX)
            )
        }
    };
    let too_long = || {
        Error::invalid_config(
            name,
            v,
            "longer than the longest timeout accel takes (365 days)",
        )
        .with_fix(DURATION_FIX)
    };
    // More than 40 digits cannot be below MAX_TIMEOUT in any unit.
    if int.len() > 40 {
        return Err(too_long());
    }
    let whole: u128 = if int.is_empty() {
        0
    } else {
        int.parse().map_err(|_| too_long())?
    };
    let mut nanos = whole.checked_mul(nanos_per).ok_or_else(too_long)?;
    // The fraction, digit by digit, to the nanosecond.
    let mut scale = nanos_per;
    for d in frac.bytes().take(30) {
        scale /= 10;
        nanos += u128::from(d - b'0') * scale;
    }
    if nanos == 0 {
        return Err(
            Error::invalid_config(name, v, "a timeout must be positive").with_fix(DURATION_FIX)
        );
    }
    if nanos > MAX_TIMEOUT.as_nanos() {
        return Err(too_long());
    }
    let secs = u64::try_from(nanos / 1_000_000_000).map_err(|_| too_long())?;
    Ok(Duration::new(secs, (nanos % 1_000_000_000) as u32))
}

/// `30s`, `1500ms`, `7ns`: the shortest exact spelling [`parse_duration`]
/// reads back.
pub fn format_duration(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else if d.subsec_nanos().is_multiple_of(1_000_000) {
        format!("{}ms", d.as_millis())
    } else {
        format!("{}ns", d.as_nanos())
    }
}

/// `tcp://host:port`, with brackets around an IPv6 address.
pub fn tcp_url(host: &str, port: u16) -> String {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    if h.contains(':') {
        format!("tcp://[{h}]:{port}")
    } else {
        format!("tcp://{h}:{port}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_digits_only() {
        assert_eq!(parse_number::<usize>("RANK", " 7 ").unwrap(), 7);
        for bad in ["+1", "-1", "1e3", "0x10", "", " ", "1 2", "٣"] {
            let e = parse_number::<usize>("RANK", bad).unwrap_err();
            assert!(e.to_string().contains("RANK"), "{bad}: {e}");
        }
        let e = parse_number::<u16>("MASTER_PORT", "70000").unwrap_err();
        assert!(e.to_string().contains("out of range"), "{e}");
    }

    #[test]
    fn durations_are_exact_and_bounded() {
        let ok = [
            ("30", Duration::from_secs(30)),
            ("1.5s", Duration::from_millis(1500)),
            ("500ms", Duration::from_millis(500)),
            ("5m", Duration::from_secs(300)),
            ("1h", Duration::from_secs(3600)),
            ("7ns", Duration::from_nanos(7)),
            ("365d", MAX_TIMEOUT),
        ];
        for (s, d) in ok {
            assert_eq!(parse_duration("T", s).unwrap(), d, "{s}");
            assert_eq!(parse_duration("T", &format_duration(d)).unwrap(), d);
        }
        for bad in [
            "100000000000000000000",
            "366d",
            "18446744073709551616s",
            "99999999999999999999999999999999999999999999h",
        ] {
            let e = parse_duration("ACCEL_TIMEOUT", bad).unwrap_err();
            assert!(e.to_string().contains("365 days"), "{bad}: {e}");
        }
        for bad in ["soon", "0", "0s", "-1s", "+1s", ".", "1.2.3s", "5 parsecs"] {
            let e = parse_duration("ACCEL_TIMEOUT", bad).unwrap_err();
            assert!(e.to_string().contains("ACCEL_TIMEOUT"), "{bad}: {e}");
        }
    }

    #[test]
    fn tcp_urls_bracket_ipv6() {
        assert_eq!(tcp_url("fd00::1", 1), "tcp://[fd00::1]:1");
        assert_eq!(tcp_url("[fd00::1]", 1), "tcp://[fd00::1]:1");
        assert_eq!(tcp_url("10.0.0.1", 2), "tcp://10.0.0.1:2");
    }
}
