//! Kubeflow Trainer's progress reporting (KEP-2779): when the pod has
//! `KUBEFLOW_TRAINER_STATUS_URL`, machine 0's launcher posts rank 0's
//! progress there (step, total steps, what the program last logged, steps
//! per second, percentage and ETA) every [`EVERY_ENV`] (default 5 s), and
//! once more when the run ends.
//!
//! The launcher posts, not the rank: it reads rank 0's status file (the one
//! `accel top` reads), so a slow or dead status server never holds up
//! training. Each post has a 5 s timeout and 2 tries; failures are said
//! once and the reporting goes on.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use accel::watch::{RankStatus, STATUS_DIR};
use accel_api::{Error, Result};
use accel_launch::running::LauncherRecord;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

/// The status server's URL (the Trainer's `Progress` plugin sets it).
pub const URL_ENV: &str = "KUBEFLOW_TRAINER_STATUS_URL";
/// A file with the CA certificate(s) of the status server, PEM.
pub const CA_ENV: &str = "KUBEFLOW_TRAINER_STATUS_CA_CERT";
/// A file with the bearer token (a projected service-account token, read
/// again before each post: it rotates).
pub const TOKEN_ENV: &str = "KUBEFLOW_TRAINER_STATUS_TOKEN";
/// How often to post (a duration: `5s`, `500ms`).
pub const EVERY_ENV: &str = "ACCEL_KUBEFLOW_STATUS_EVERY";

const DEFAULT_EVERY: Duration = Duration::from_secs(5);
const POST_TIMEOUT: Duration = Duration::from_secs(5);
const TRIES: usize = 2;

/// Where and how to post.
#[derive(Debug, Clone)]
pub struct Target {
    url: String,
    ca: Option<PathBuf>,
    token: Option<PathBuf>,
    every: Duration,
}

impl Target {
    /// From the environment: `None` without [`URL_ENV`].
    ///
    /// # Errors
    /// A malformed [`EVERY_ENV`], or a URL that is not `https://` (or
    /// `http://`), named with the fix.
    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<Option<Target>> {
        let Some(url) = get(URL_ENV).filter(|u| !u.is_empty()) else {
            return Ok(None);
        };
        if !(url.starts_with("https://") || url.starts_with("http://")) {
            return Err(Error::invalid_argument(
                "accel launch",
                format!("{URL_ENV}={url:?} is not an http(s) URL"),
            )
            .with_fix(format!(
                "unset {URL_ENV}, or give the status server's https:// URL"
            )));
        }
        let every = match get(EVERY_ENV) {
            None => DEFAULT_EVERY,
            Some(v) => accel_api::worker::parse_duration(EVERY_ENV, &v)?,
        };
        Ok(Some(Target {
            url,
            ca: get(CA_ENV).filter(|v| !v.is_empty()).map(PathBuf::from),
            token: get(TOKEN_ENV).filter(|v| !v.is_empty()).map(PathBuf::from),
            every,
        }))
    }

    fn agent(&self) -> Result<ureq::Agent> {
        let mut b = ureq::AgentBuilder::new().timeout(POST_TIMEOUT);
        if let Some(ca) = &self.ca {
            let bad = |e: String| {
                Error::invalid_argument("accel launch", format!("{CA_ENV}={}: {e}", ca.display()))
                    .with_fix("point it at the status server's CA certificate (PEM)")
            };
            let mut roots = rustls::RootCertStore::empty();
            let certs = CertificateDer::pem_file_iter(ca).map_err(|e| bad(e.to_string()))?;
            for c in certs {
                roots
                    .add(c.map_err(|e| bad(e.to_string()))?)
                    .map_err(|e| bad(e.to_string()))?;
            }
            if roots.is_empty() {
                return Err(bad("no certificate in the file".into()));
            }
            // ring, as ureq 2 builds rustls (aws-lc-rs would add a CMake
            // build); rustls 0.23.48 deprecates it for lacking post-quantum
            // key exchange, which a cluster-internal status post can do without.
            #[allow(deprecated)]
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let cfg = rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| bad(e.to_string()))?
                .with_root_certificates(roots)
                .with_no_client_auth();
            b = b.tls_config(Arc::new(cfg));
        }
        Ok(b.build())
    }
}

/// A running reporter: [`Reporter::finish`] posts the last status and stops it.
pub struct Reporter {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// Start posting rank 0's progress (its status file, found through the
/// launcher's `record`) to `target`.
///
/// # Errors
/// A CA file that cannot be read or holds no certificate.
pub fn start(target: Target, record: PathBuf) -> Result<Reporter> {
    let agent = target.agent()?;
    let stop = Arc::new(AtomicBool::new(false));
    let st = stop.clone();
    let thread = std::thread::Builder::new()
        .name("accel-kubeflow".into())
        .spawn(move || {
            let mut poster = Poster {
                target,
                agent,
                rate: Rate::default(),
                warned: false,
            };
            let mut next = Instant::now();
            loop {
                let last = st.load(Ordering::SeqCst);
                if last || Instant::now() >= next {
                    if let Some(status) = read_rank0(&record) {
                        poster.post(&status, last);
                    }
                    next = Instant::now() + poster.target.every;
                }
                if last {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
        .map_err(|e| Error::io("starting the Kubeflow status reporter", e))?;
    Ok(Reporter {
        stop,
        thread: Some(thread),
    })
}

impl Reporter {
    /// Post the final status and stop (bounded by the posts' timeouts).
    pub fn finish(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Rank 0's status file, through the launcher's record of its dump folder.
fn read_rank0(record: &Path) -> Option<RankStatus> {
    let rec = LauncherRecord::read(record).ok()?;
    let file = rec.dump_dir.join(STATUS_DIR).join("rank0.json");
    serde_json::from_slice(&std::fs::read(file).ok()?).ok()
}

/// Steps per second between the first and the latest status seen.
#[derive(Default)]
struct Rate {
    first: Option<(u64, u64)>,
}

impl Rate {
    fn per_second(&mut self, step: u64, time_us: u64) -> Option<f64> {
        let (s0, t0) = *self.first.get_or_insert((step, time_us));
        let dt = time_us.saturating_sub(t0) as f64 / 1e6;
        (dt > 0.0 && step > s0).then(|| (step - s0) as f64 / dt)
    }
}

struct Poster {
    target: Target,
    agent: ureq::Agent,
    rate: Rate,
    warned: bool,
}

impl Poster {
    fn post(&mut self, status: &RankStatus, last: bool) {
        let rate = self
            .rate
            .per_second(status.metrics_step.unwrap_or(status.step), status.time_us);
        let body = payload(status, rate, SystemTime::now()).to_string();
        let token = self
            .target
            .token
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok());
        let mut said = None;
        for _ in 0..TRIES {
            let mut req = self
                .agent
                .post(&self.target.url)
                .set("Content-Type", "application/json");
            if let Some(t) = &token {
                req = req.set("Authorization", &format!("Bearer {}", t.trim()));
            }
            match req.send_string(&body) {
                Ok(_) => return,
                Err(e) => said = Some(e.to_string()),
            }
            if last {
                break;
            }
        }
        if let Some(e) = said.filter(|_| !self.warned) {
            self.warned = true;
            accel_launch::output::say(&format!(
                "the Kubeflow status post to {} failed ({e}); training goes on, and so do the posts",
                self.target.url
            ));
        }
    }
}

/// The body Kubeflow Trainer's status server takes (`trainerStatus`).
fn payload(s: &RankStatus, per_second: Option<f64>, now: SystemTime) -> serde_json::Value {
    let step = s.metrics_step.unwrap_or(s.step);
    let mut metrics = vec![("step".to_string(), step.to_string())];
    if let Some(t) = s.total_steps {
        metrics.push(("total_steps".into(), t.to_string()));
    }
    for (k, v) in &s.metrics {
        metrics.push((k.clone(), v.to_string()));
    }
    if let Some(r) = per_second {
        metrics.push(("steps_per_second".into(), format!("{r:.3}")));
    }
    let mut status = serde_json::json!({
        "metrics": metrics
            .into_iter()
            .map(|(name, value)| serde_json::json!({"name": name, "value": value}))
            .collect::<Vec<_>>(),
        "lastUpdatedTime": rfc3339(now),
    });
    if let Some(total) = s.total_steps.filter(|t| *t > 0) {
        let pct = (step.min(total) * 100 / total).min(100);
        status["progressPercentage"] = pct.into();
        if let Some(r) = per_second.filter(|r| *r > 0.0) {
            status["estimatedRemainingSeconds"] =
                ((total.saturating_sub(step) as f64 / r).round() as u64).into();
        }
    }
    serde_json::json!({ "trainerStatus": status })
}

/// `2026-12-05T16:30:00Z` (UTC, seconds).
fn rfc3339(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Days since 1970-01-01 to a civil date (proleptic Gregorian).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(step: u64, total: Option<u64>) -> RankStatus {
        let mut s: RankStatus = serde_json::from_value(serde_json::json!({
            "rank": 0, "world_size": 2, "pid": 1, "time_us": 0,
            "section": "step", "section_ms": 0.0, "step": step, "phase": null,
        }))
        .unwrap();
        s.total_steps = total;
        s.metrics_step = Some(step);
        s.metrics.insert("loss".into(), 0.25);
        s
    }

    #[test]
    fn the_payload_has_progress_eta_and_metrics_as_kubeflow_takes_them() {
        let p = payload(&status(30, Some(120)), Some(3.0), UNIX_EPOCH);
        let t = &p["trainerStatus"];
        assert_eq!(t["progressPercentage"], 25);
        assert_eq!(t["estimatedRemainingSeconds"], 30);
        assert_eq!(t["lastUpdatedTime"], "1970-01-01T00:00:00Z");
        let m: Vec<(String, String)> = t["metrics"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                (
                    m["name"].as_str().unwrap().into(),
                    m["value"].as_str().unwrap().into(),
                )
            })
            .collect();
        for want in [
            ("step", "30"),
            ("total_steps", "120"),
            ("loss", "0.25"),
            ("steps_per_second", "3.000"),
        ] {
            assert!(m.contains(&(want.0.into(), want.1.into())), "{m:?}");
        }
        // Without a total: no percentage, no ETA.
        let p = payload(&status(30, None), Some(3.0), UNIX_EPOCH);
        assert!(p["trainerStatus"].get("progressPercentage").is_none());
        assert!(p["trainerStatus"]
            .get("estimatedRemainingSeconds")
            .is_none());
    }

    #[test]
    fn times_are_utc_rfc3339() {
        let t = UNIX_EPOCH + Duration::from_secs(1_796_488_200); // 2026-12-05T16:30:00Z
        assert_eq!(rfc3339(t), "2026-12-05T16:30:00Z");
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_secs(951_782_400)),
            "2000-02-29T00:00:00Z"
        );
    }

    #[test]
    fn the_environment_is_checked() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert!(Target::from_env(env(&[])).unwrap().is_none());
        let t = Target::from_env(env(&[(URL_ENV, "https://s:8443/status")]))
            .unwrap()
            .unwrap();
        assert_eq!(t.every, DEFAULT_EVERY);
        let e = Target::from_env(env(&[(URL_ENV, "s:8443")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains(URL_ENV), "{e}");
        let e = Target::from_env(env(&[(URL_ENV, "https://s"), (EVERY_ENV, "soon")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains(EVERY_ENV), "{e}");
    }

    #[test]
    fn steps_per_second_come_from_the_first_and_latest_status() {
        let mut r = Rate::default();
        assert_eq!(r.per_second(10, 1_000_000), None);
        assert_eq!(r.per_second(20, 3_000_000), Some(5.0));
    }
}
