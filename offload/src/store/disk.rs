use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use accel_api::{Error, OffloadStore, Result, TensorMeta};

use crate::arena::Arena;
use crate::safetensors::{write_file, SafetensorsFile, TensorEntry};

#[derive(Debug)]
struct Slot {
    file: Arc<SafetensorsFile>,
    entry: usize,
}

/// Tensors in safetensors files, memory-mapped: `get` borrows from the
/// mapping (zero-copy; the kernel pages data in on first touch).
///
/// `put` writes one file per tensor, `<dir>/<name>.safetensors`,
/// atomically (temporary file, fsync, rename). [`DiskStore::open`] also
/// serves every `.safetensors` file already in the directory, and
/// [`DiskStore::add_file`] serves an existing file (e.g. a checkpoint shard)
/// in place, without copying it.
#[derive(Debug)]
pub struct DiskStore {
    dir: PathBuf,
    slots: Arena<Slot>,
    index: RwLock<HashMap<String, usize>>,
    /// The folder of [`DiskStore::open_temp`], removed on drop: declared
    /// last, so the mappings in `slots` are gone first.
    _temp: Option<RemoveOnDrop>,
}

/// A folder removed when dropped (also when opening fails half-way).
#[derive(Debug)]
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl DiskStore {
    /// A store writing into `dir` (created if needed) and serving the
    /// `.safetensors` files already there.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`](accel_api::ErrorKind::Corrupt) for a truncated
    /// or lying file, naming file and tensor; [`ErrorKind::Io`](accel_api::ErrorKind::Io).
    pub fn open(dir: &Path) -> Result<DiskStore> {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
        let s = DiskStore {
            dir: dir.to_path_buf(),
            slots: Arena::default(),
            index: RwLock::new(HashMap::new()),
            _temp: None,
        };
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| Error::io(format!("list {}", dir.display()), e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.extension().is_some_and(|x| x == "safetensors")
                    && !p
                        .file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with('.'))
            })
            .collect();
        files.sort();
        for f in files {
            s.add_file(&f)?;
        }
        Ok(s)
    }

    /// A store in a new folder `<prefix>-<pid>-<n>` under the system's
    /// temporary directory, removed with its contents when the store is
    /// dropped (or when opening fails).
    ///
    /// # Errors
    /// [`ErrorKind::Io`](accel_api::ErrorKind::Io) when the folder cannot
    /// be created.
    pub fn open_temp(prefix: &str) -> Result<DiskStore> {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "{prefix}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let guard = RemoveOnDrop(dir.clone());
        let mut s = DiskStore::open(&dir)?;
        s._temp = Some(guard);
        Ok(s)
    }

    /// Serve every tensor of the safetensors file `path` from its mapping.
    pub fn add_file(&self, path: &Path) -> Result<()> {
        let f = Arc::new(SafetensorsFile::open(path)?);
        let mut idx = self.index.write().expect("disk store lock");
        for (i, e) in f.entries().iter().enumerate() {
            let slot = self.slots.push(Slot {
                file: f.clone(),
                entry: i,
            });
            idx.insert(e.name.clone(), slot);
        }
        Ok(())
    }

    /// Copy the bytes of `name` into `out` with positioned reads instead of
    /// borrowing them from the mapping ([`SafetensorsFile::read_into`]):
    /// for a caller that materialises a tensor in its own buffer and must
    /// not leave the file's pages resident in the process.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
    /// for an unknown name or a buffer of the wrong length;
    /// [`ErrorKind::Io`](accel_api::ErrorKind::Io).
    pub fn read_into(&self, name: &str, out: &mut [u8]) -> Result<()> {
        let (f, e) = self.slot(name)?;
        f.read_into(e, out)
    }

    /// The directory written to.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn slot(&self, name: &str) -> Result<(&SafetensorsFile, &TensorEntry)> {
        let i = self
            .index
            .read()
            .expect("disk store lock")
            .get(name)
            .copied();
        let s = i
            .and_then(|i| self.slots.get(i))
            .ok_or_else(|| super::missing(&format!("disk store {}", self.dir.display()), name))?;
        Ok((&s.file, &s.file.entries()[s.entry]))
    }
}

impl OffloadStore for DiskStore {
    fn get(&self, name: &str) -> Result<Cow<'_, [u8]>> {
        let (f, e) = self.slot(name)?;
        Ok(Cow::Borrowed(f.data(e)))
    }

    fn put(&self, name: &str, meta: TensorMeta, data: &[u8]) -> Result<()> {
        super::check_len("disk store", name, &meta, data)?;
        let path = self
            .dir
            .join(format!("{}.safetensors", super::file_stem(name)));
        write_file(&path, [(name, &meta, data)])?;
        let f = Arc::new(SafetensorsFile::open(&path)?);
        let entry = f
            .entries()
            .iter()
            .position(|e| e.name == name)
            .expect("just written");
        let slot = self.slots.push(Slot { file: f, entry });
        self.index
            .write()
            .expect("disk store lock")
            .insert(name.to_string(), slot);
        Ok(())
    }

    fn contains(&self, name: &str) -> bool {
        self.index
            .read()
            .expect("disk store lock")
            .contains_key(name)
    }

    fn keys(&self) -> Vec<String> {
        let mut k: Vec<String> = self
            .index
            .read()
            .expect("disk store lock")
            .keys()
            .cloned()
            .collect();
        k.sort();
        k
    }

    fn meta(&self, name: &str) -> Result<TensorMeta> {
        Ok(self.slot(name)?.1.meta.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use accel_api::{DType, ErrorKind};

    #[test]
    fn disk_store_conformance_and_reopen() {
        let d = tempfile::tempdir().unwrap();
        let s = DiskStore::open(d.path()).unwrap();
        super::super::conformance::check(&s);
        drop(s);
        let s = DiskStore::open(d.path()).unwrap();
        assert_eq!(s.keys().len(), 2);
        assert_eq!(
            s.get("layers.0.w").unwrap().as_ref(),
            &(100..116).collect::<Vec<u8>>()[..]
        );
        assert!(matches!(s.get("layers.0.w").unwrap(), Cow::Borrowed(_)));
        // Positioned reads give the same bytes; a wrong-sized buffer is refused.
        let mut out = vec![0u8; 16];
        s.read_into("layers.0.w", &mut out).unwrap();
        assert_eq!(out, (100..116).collect::<Vec<u8>>());
        let e = s.read_into("layers.0.w", &mut [0u8; 3]).unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument);
        assert!(s.read_into("nope", &mut out).is_err());
        // No temporary files are left behind.
        assert!(std::fs::read_dir(d.path()).unwrap().all(|e| !e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .starts_with('.')));
    }

    #[test]
    fn temp_store_folder_is_unique_and_removed_on_drop() {
        let a = DiskStore::open_temp("accel-offload-test").unwrap();
        let b = DiskStore::open_temp("accel-offload-test").unwrap();
        assert_ne!(a.dir(), b.dir());
        assert!(a.dir().starts_with(std::env::temp_dir()));
        let meta = TensorMeta {
            dtype: DType::U8,
            shape: vec![4],
        };
        a.put("w", meta, &[1, 2, 3, 4]).unwrap();
        let dir = a.dir().to_path_buf();
        assert!(dir.join("w.safetensors").is_file());
        drop(a);
        assert!(!dir.exists(), "{} is left behind", dir.display());
        assert!(b.dir().is_dir());
    }

    #[test]
    fn truncated_file_in_store_names_file_and_tensor() {
        let d = tempfile::tempdir().unwrap();
        let s = DiskStore::open(d.path()).unwrap();
        s.put(
            "blk.w",
            TensorMeta {
                dtype: DType::F16,
                shape: vec![64],
            },
            &[1u8; 128],
        )
        .unwrap();
        drop(s);
        let p = d.path().join("blk.w.safetensors");
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 1]).unwrap();
        let e = DiskStore::open(d.path()).unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::Corrupt);
        let m = e.to_string();
        assert!(
            m.contains("blk.w.safetensors") && m.contains("`blk.w`"),
            "{m}"
        );
    }
}
