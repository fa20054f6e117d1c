use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::RwLock;

use accel_api::{OffloadStore, Result, TensorMeta};

use crate::arena::Arena;

/// Tensors in host RAM. `get` borrows without copying.
#[derive(Debug, Default)]
pub struct HostStore {
    slots: Arena<(TensorMeta, Box<[u8]>)>,
    index: RwLock<HashMap<String, usize>>,
}

impl HostStore {
    /// An empty store.
    pub fn new() -> HostStore {
        HostStore::default()
    }

    /// Bytes held by the current tensors (replaced ones not counted).
    pub fn bytes(&self) -> u64 {
        let idx = self.index.read().expect("host store lock");
        idx.values()
            .filter_map(|&i| self.slots.get(i))
            .map(|(_, d)| d.len() as u64)
            .sum()
    }

    fn slot(&self, name: &str) -> Result<&(TensorMeta, Box<[u8]>)> {
        let i = self
            .index
            .read()
            .expect("host store lock")
            .get(name)
            .copied();
        i.and_then(|i| self.slots.get(i))
            .ok_or_else(|| super::missing("host store", name))
    }
}

impl OffloadStore for HostStore {
    fn get(&self, name: &str) -> Result<Cow<'_, [u8]>> {
        Ok(Cow::Borrowed(&self.slot(name)?.1))
    }

    fn put(&self, name: &str, meta: TensorMeta, data: &[u8]) -> Result<()> {
        super::check_len("host store", name, &meta, data)?;
        let i = self.slots.push((meta, data.into()));
        self.index
            .write()
            .expect("host store lock")
            .insert(name.to_string(), i);
        Ok(())
    }

    fn contains(&self, name: &str) -> bool {
        self.index
            .read()
            .expect("host store lock")
            .contains_key(name)
    }

    fn keys(&self) -> Vec<String> {
        let mut k: Vec<String> = self
            .index
            .read()
            .expect("host store lock")
            .keys()
            .cloned()
            .collect();
        k.sort();
        k
    }

    fn meta(&self, name: &str) -> Result<TensorMeta> {
        Ok(self.slot(name)?.0.clone())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn host_store_conformance() {
        super::super::conformance::check(&super::HostStore::new());
    }
}
