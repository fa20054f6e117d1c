//! Seeding and threading: what a tch program sets once per rank.

use accel::Accelerator;

/// Seed accel's per-process generator (as
/// [`Accelerator::set_seed`]) and libtorch's generators (CPU and every CUDA
/// device) with the same seed: `seed`, or `seed + rank` when
/// `device_specific` (different dropout masks per rank). Not collective.
pub fn set_seed(acc: &Accelerator, seed: u64, device_specific: bool) {
    acc.set_seed(seed, device_specific);
    let s = if device_specific {
        seed.wrapping_add(acc.rank() as u64)
    } else {
        seed
    };
    // libtorch seeds the CPU generator and, when CUDA is present, every
    // device's generator (torch.manual_seed).
    tch::manual_seed(s as i64);
}

/// Give libtorch's intra-op thread pool this rank's share of the machine's
/// cores (`cores / local_world_size`, at least 1), as torchrun's
/// `OMP_NUM_THREADS` advice does: N ranks each using every core oversubscribe
/// the CPU. Returns the thread count set.
pub fn set_threads_per_rank(acc: &Accelerator) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let n = (cores / acc.state().local_world_size.max(1)).max(1);
    tch::set_num_threads(n as i32);
    n
}
