//! The conformance suite on cpu-gloo with ranks as threads of this process
//! (over loopback TCP), one test per scenario at world sizes 1 to 4. The
//! suite holds the oracle; the tests beside this file cover what is
//! particular to Gloo (its framing, rounding, failures and splits).

accel_conformance::conformance_tests!(
    in_process = std::sync::Arc::new(accel_backend_cpu_gloo::BACKEND),
    world_sizes = [1, 2, 3, 4],
    scenarios = [
        all_reduce,
        reduce,
        broadcast,
        all_gather,
        gather,
        scatter,
        reduce_scatter,
        all_to_all,
        send_recv_ring,
        all_reduce_multi_mib,
        barrier_ordering,
        split_subgroups,
        varsize_gather,
        pad_across_processes,
        objects,
        undeclared_is_unsupported,
        invalid_arguments,
        missing_rank_times_out,
        lost_rank_is_named,
        debug_mismatch_table,
        train_sharding,
        train_accelerate_golden,
        train_accumulation_cadence,
        train_equivalence,
        train_resume,
        train_fp16_skip_agreed,
        train_bf16_equivalence,
        train_clip_norm_agreed,
        zero_equivalence,
        zero_clipping,
    ],
);
