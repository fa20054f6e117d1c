//! The 8x8 handwritten digits of the UCI/scikit-learn data set (1,797
//! images, 10 classes), as both digits demos read, split and batch it.
//!
//! The data file is `sklearn/datasets/data/digits.csv.gz` from the
//! scikit-learn wheel (`ACCEL_DIGITS_CSV`, default
//! `.accel-cache/tch/data/digits.csv.gz`; `scripts/digits_data.sh` fetches
//! it alone, `make tch-setup` does too and exports its path in
//! `.accel-cache/tch/env.sh`).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use accel::train::Dataset;
use accel::{Error, ErrorKind, Result};

/// Pixels per image.
pub const FEATURES: usize = 64;
/// Classes.
pub const CLASSES: usize = 10;

/// The digits data set (or a batch of it): pixel values 0..=16 scaled to
/// [0, 1], and labels.
#[derive(Debug)]
pub struct Digits {
    /// `len * FEATURES` pixels, row-major.
    pub pixels: Vec<f32>,
    /// One label per image.
    pub labels: Vec<u32>,
}

impl Digits {
    /// Number of images.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// `true` when there is no image.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Read scikit-learn's `digits.csv.gz` (65 integers a line: 64 pixels,
    /// then the label).
    ///
    /// # Errors
    /// [`ErrorKind::Io`] when the file cannot be read, [`ErrorKind::Corrupt`]
    /// naming the line when one does not parse.
    pub fn load(path: &Path) -> Result<Digits> {
        let file = std::fs::File::open(path).map_err(|e| {
            Error::io(format!("opening {}", path.display()), e).with_fix(
                "run scripts/digits_data.sh (or `make tch-setup` and source \
                 .accel-cache/tch/env.sh), or pass --data",
            )
        })?;
        let reader = BufReader::new(flate2::read::GzDecoder::new(file));
        let (mut pixels, mut labels) = (Vec::new(), Vec::new());
        for (n, line) in reader.lines().enumerate() {
            let line = line.map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
            if line.trim().is_empty() {
                continue;
            }
            let bad = |why: String| {
                Error::new(
                    ErrorKind::Corrupt,
                    format!("{} line {}: {why}", path.display(), n + 1),
                )
            };
            let values = line
                .split(',')
                .map(|v| v.trim().parse::<f32>())
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| bad(format!("not a number ({e})")))?;
            let [px @ .., label] = values.as_slice() else {
                return Err(bad("empty line".into()));
            };
            if px.len() != FEATURES {
                return Err(bad(format!(
                    "{} values, expected {}",
                    values.len(),
                    FEATURES + 1
                )));
            }
            if !(0.0..CLASSES as f32).contains(label) || label.fract() != 0.0 {
                return Err(bad(format!("label {label} is not a digit")));
            }
            pixels.extend(px.iter().map(|v| v / 16.0));
            labels.push(*label as u32);
        }
        Ok(Digits { pixels, labels })
    }

    /// The default location: `$ACCEL_DIGITS_CSV`, else the set-up
    /// scripts' cache folder under the repository.
    pub fn default_path() -> PathBuf {
        std::env::var_os("ACCEL_DIGITS_CSV")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("../../.accel-cache/tch/data/digits.csv.gz")
            })
    }

    /// A deterministic split: every fifth image is held out for evaluation
    /// (360 images), the rest train (1,437).
    pub fn split(self: &Arc<Self>) -> (Split, Split) {
        let (test, train): (Vec<usize>, Vec<usize>) = (0..self.len()).partition(|i| i % 5 == 0);
        let split = |indices| Split {
            data: self.clone(),
            indices,
        };
        (split(train), split(test))
    }
}

/// A subset of the images, as a map-style [`Dataset`] of positions in it.
#[derive(Clone, Debug)]
pub struct Split {
    data: Arc<Digits>,
    indices: Vec<usize>,
}

impl Split {
    /// The first `n` images of the split.
    pub fn truncate(mut self, n: usize) -> Split {
        self.indices.truncate(n);
        self
    }

    /// The first `n` images when `n` is set, else all of them.
    pub fn truncate_to(self, n: Option<usize>) -> Split {
        match n {
            Some(n) => self.truncate(n),
            None => self,
        }
    }

    /// The images `items` (positions in this split), as a small data set
    /// of their own.
    pub fn batch(&self, items: &[usize]) -> Digits {
        let mut pixels = Vec::with_capacity(items.len() * FEATURES);
        let mut labels = Vec::with_capacity(items.len());
        for &i in items {
            let j = self.indices[i];
            pixels.extend_from_slice(&self.data.pixels[j * FEATURES..(j + 1) * FEATURES]);
            labels.push(self.data.labels[j]);
        }
        Digits { pixels, labels }
    }
}

impl Dataset for Split {
    type Item = usize;
    fn len(&self) -> usize {
        self.indices.len()
    }
    fn get(&self, index: usize) -> usize {
        index
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn gz(dir: &Path, text: &str) -> PathBuf {
        let path = dir.join("digits.csv.gz");
        let mut enc = flate2::write::GzEncoder::new(
            std::fs::File::create(&path).expect("create"),
            flate2::Compression::fast(),
        );
        enc.write_all(text.as_bytes()).expect("write");
        enc.finish().expect("finish");
        path
    }

    fn line(pixel: u32, label: &str) -> String {
        let mut v: Vec<String> = (0..FEATURES).map(|_| pixel.to_string()).collect();
        v.push(label.to_string());
        v.join(",")
    }

    #[test]
    fn loads_splits_and_batches() {
        let dir = tempfile::tempdir().expect("tempdir");
        let text: Vec<String> = (0..10)
            .map(|i| line(16 * (i % 2), &i.to_string()))
            .collect();
        let data = Arc::new(Digits::load(&gz(dir.path(), &text.join("\n"))).expect("load"));
        assert_eq!(data.len(), 10);
        let (train, test) = data.split();
        assert_eq!((train.len(), test.len()), (8, 2));
        // Held out: images 0 and 5.
        let b = test.batch(&[0, 1]);
        assert_eq!(b.labels, vec![0, 5]);
        assert_eq!((b.len(), b.pixels.len()), (2, 2 * FEATURES));
        assert_eq!((b.pixels[0], b.pixels[FEATURES]), (0.0, 1.0));
        assert_eq!(train.truncate_to(Some(3)).len(), 3);
    }

    #[test]
    fn a_bad_line_is_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = gz(dir.path(), &format!("{}\n{}", line(1, "3"), line(1, "12")));
        let e = Digits::load(&path).expect_err("label 12");
        assert_eq!(*e.kind(), ErrorKind::Corrupt);
        assert!(
            e.to_string().contains("line 2: label 12 is not a digit"),
            "{e}"
        );
    }
}
