use super::*;

fn vars(kv: &[(&str, &str)]) -> Vars {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn err(kv: &[(&str, &str)]) -> String {
    let e = ProcessState::from_vars(vars(kv)).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::InvalidConfig), "{e}");
    e.to_string()
}

#[test]
fn plain_shell_is_one_process() {
    let s = ProcessState::from_vars(vars(&[])).unwrap();
    assert_eq!(
        (s.rank, s.world_size, s.local_rank, s.local_world_size),
        (0, 1, 0, 1)
    );
    assert_eq!(s.source, LaunchSource::None);
    assert_eq!(s.timeout, DEFAULT_TIMEOUT);
    assert_eq!(s.store_location().unwrap(), None);
}

#[test]
fn torchrun_variables() {
    let s = ProcessState::from_vars(vars(&[
        ("RANK", "5"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("GROUP_RANK", "1"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "29500"),
        ("TORCHELASTIC_RUN_ID", "abc"),
        ("ACCEL_TIMEOUT", "90s"),
    ]))
    .unwrap();
    assert_eq!(
        (
            s.rank,
            s.world_size,
            s.local_rank,
            s.local_world_size,
            s.node_rank
        ),
        (5, 8, 1, 4, 1)
    );
    assert_eq!(s.source, LaunchSource::Torchrun);
    assert_eq!(s.run_id, "abc");
    assert_eq!(s.timeout, Duration::from_secs(90));
    // No token: torch's protocol (issue 26: torchrun's workers hung on
    // accel's own protocol), hosted by rank 0 unless torchrun's agent does.
    assert_eq!(
        s.store_location().unwrap().unwrap(),
        "torch://10.0.0.1:29500"
    );
    assert!(!s.hosts_store());
    assert!(!s.is_main_process() && !s.is_local_main_process() && !s.is_last_process());
}

#[test]
fn slurm_hostlists_give_their_first_host() {
    for (list, first) in [
        ("vm", Some("vm")),
        ("n[01-03,7],gpu1", Some("n01")),
        ("gpu1,n[1-2]", Some("gpu1")),
        ("rack[3-4]-node", Some("rack3-node")),
        ("n[007]", Some("n007")),
        ("", None),
        ("n[x-y]", None),
        ("n[1-2", None),
    ] {
        assert_eq!(slurm_first_host(list).as_deref(), first, "{list:?}");
    }
}

#[test]
fn srun_alone_names_a_store_rank_0_hosts_on_the_first_node() {
    let base = [
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_STEP_NODELIST", "n[03-04]"),
        ("SLURM_JOB_ID", "777"),
        ("SLURM_STEP_ID", "1"),
    ];
    let s = ProcessState::from_vars(vars(&base)).unwrap();
    assert!(s.hosts_store());
    let (job, step) = (777, 1);
    let port = 20000 + (job * 131 + step) % 20000;
    assert_eq!(
        s.store_location().unwrap().unwrap(),
        format!("torch://n03:{port}")
    );
    // Another step of the same job gets another port.
    let mut kv = base.to_vec();
    kv[4] = ("SLURM_STEP_ID", "2");
    let s2 = ProcessState::from_vars(vars(&kv)).unwrap();
    assert_ne!(s2.master_port, s.master_port);
    // MASTER_ADDR/MASTER_PORT override, ACCEL_STORE_URL replaces it.
    let mut kv = base.to_vec();
    kv.push(("MASTER_PORT", "29400"));
    let s3 = ProcessState::from_vars(vars(&kv)).unwrap();
    assert_eq!(s3.store_location().unwrap().unwrap(), "torch://n03:29400");
    let mut kv = base.to_vec();
    kv.push(("ACCEL_STORE_URL", "file:///x"));
    assert!(!ProcessState::from_vars(vars(&kv)).unwrap().hosts_store());
}

#[test]
fn who_hosts_a_store_named_by_master_addr() {
    let base = [
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];
    let with = |extra: &[(&'static str, &'static str)]| {
        let mut kv: Vec<_> = base.to_vec();
        kv.extend_from_slice(extra);
        ProcessState::from_vars(vars(&kv)).unwrap()
    };
    // Kubeflow style / by hand: rank 0 hosts a torch-protocol store.
    let r0 = with(&[("RANK", "0")]);
    assert!(r0.hosts_store() && !with(&[("RANK", "1")]).hosts_store());
    assert_eq!(
        r0.store_location().unwrap().unwrap(),
        "torch://127.0.0.1:29500"
    );
    // torchrun's agent hosts it: nobody else does.
    let agent = with(&[("RANK", "0"), ("TORCHELASTIC_USE_AGENT_STORE", "True")]);
    assert!(agent.agent_store && !agent.hosts_store());
    assert_eq!(
        agent.store_location().unwrap().unwrap(),
        "torch://127.0.0.1:29500"
    );
    // A run token means accel's own store, hosted by its launcher.
    let tok = with(&[("RANK", "0"), ("ACCEL_RUN_TOKEN", "t")]);
    assert!(!tok.hosts_store());
    assert_eq!(
        tok.store_location().unwrap().unwrap(),
        "tcp://127.0.0.1:29500"
    );
    // ACCEL_STORE_URL wins over all of it.
    let url = with(&[("RANK", "0"), ("ACCEL_STORE_URL", "file:///tmp/s")]);
    assert!(!url.hosts_store());
    assert_eq!(url.store_location().unwrap().unwrap(), "file:///tmp/s");
}

#[test]
fn torchrun_family_errors_name_the_variable() {
    assert!(err(&[("RANK", "5"), ("WORLD_SIZE", "2")]).contains("RANK=5"));
    assert!(err(&[("RANK", "x"), ("WORLD_SIZE", "2")]).contains("RANK=\"x\""));
    assert!(err(&[("RANK", "0")]).contains("WORLD_SIZE is not"));
    assert!(err(&[("RANK", "0"), ("WORLD_SIZE", "0")]).contains("WORLD_SIZE"));
    let m = err(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "2"),
        ("LOCAL_WORLD_SIZE", "2"),
    ]);
    assert!(
        m.contains("LOCAL_RANK=2") && m.contains("LOCAL_WORLD_SIZE=2"),
        "{m}"
    );
    assert!(
        err(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "70000")])
            .contains("MASTER_PORT")
    );
    assert!(err(&[("ACCEL_TIMEOUT", "soon")]).contains("ACCEL_TIMEOUT"));
    assert!(err(&[("ACCEL_DEBUG", "maybe")]).contains("ACCEL_DEBUG"));
    assert!(err(&[("ACCEL_CHECK_CALLS", "sometimes")]).contains("ACCEL_CHECK_CALLS"));
}

#[test]
fn openmpi_variables_and_contradiction() {
    let s = ProcessState::from_vars(vars(&[
        ("OMPI_COMM_WORLD_RANK", "3"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
    ]))
    .unwrap();
    assert_eq!(
        (s.rank, s.world_size, s.local_rank, s.node_rank),
        (3, 4, 1, 1)
    );
    assert!(s.mpi_launched && s.source == LaunchSource::OpenMpi);
    let m = err(&[("OMPI_COMM_WORLD_RANK", "4"), ("OMPI_COMM_WORLD_SIZE", "4")]);
    assert!(m.contains("OMPI_COMM_WORLD_RANK=4"), "{m}");
    let m = err(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
    ]);
    assert!(
        m.contains("contradict") && m.contains("OMPI_COMM_WORLD_SIZE=4"),
        "{m}"
    );
    // accel launch workers inside an outer mpirun ignore the MPI ranks.
    let s = ProcessState::from_vars(vars(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("ACCEL_LAUNCHER", "accel"),
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
    ]))
    .unwrap();
    assert_eq!((s.rank, s.source), (1, LaunchSource::Accel));
}

#[test]
fn mpich_and_mvapich_variables() {
    let s = ProcessState::from_vars(vars(&[
        ("PMI_RANK", "2"),
        ("PMI_SIZE", "3"),
        ("MPI_LOCALRANKID", "2"),
        ("MPI_LOCALNRANKS", "3"),
    ]))
    .unwrap();
    assert_eq!(
        (s.rank, s.world_size, s.local_rank, s.source),
        (2, 3, 2, LaunchSource::Mpich)
    );
    assert!(err(&[("PMI_RANK", "-1"), ("PMI_SIZE", "3")]).contains("PMI_RANK"));
    assert!(err(&[
        ("PMI_RANK", "1"),
        ("PMI_SIZE", "3"),
        ("MPI_LOCALRANKID", "3"),
        ("MPI_LOCALNRANKS", "3")
    ])
    .contains("MPI_LOCALRANKID=3"));
    let s = ProcessState::from_vars(vars(&[
        ("MV2_COMM_WORLD_RANK", "1"),
        ("MV2_COMM_WORLD_SIZE", "2"),
    ]))
    .unwrap();
    assert_eq!((s.rank, s.source), (1, LaunchSource::Mvapich));
    assert!(
        err(&[("MV2_COMM_WORLD_RANK", "2"), ("MV2_COMM_WORLD_SIZE", "2")])
            .contains("MV2_COMM_WORLD_RANK=2")
    );
}

#[test]
fn slurm_variables() {
    let s = ProcessState::from_vars(vars(&[
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "7"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NODEID", "2"),
        ("SLURM_TASKS_PER_NODE", "2(x3),1"),
    ]))
    .unwrap();
    assert_eq!(
        (
            s.rank,
            s.world_size,
            s.local_rank,
            s.local_world_size,
            s.node_rank
        ),
        (5, 7, 1, 2, 2)
    );
    assert!(err(&[("SLURM_PROCID", "7"), ("SLURM_NTASKS", "7")]).contains("SLURM_PROCID=7"));
    assert!(err(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_NODEID", "0"),
        ("SLURM_TASKS_PER_NODE", "2(x")
    ])
    .contains("SLURM_TASKS_PER_NODE"));
    // Inside salloc without srun, SLURM_NTASKS alone does not make a rank.
    let s = ProcessState::from_vars(vars(&[("SLURM_NTASKS", "4")]));
    assert!(s.is_err());
}

#[test]
fn device_binding_refuses_oversubscription() {
    let mut s = ProcessState::from_vars(vars(&[
        ("RANK", "3"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "3"),
        ("LOCAL_WORLD_SIZE", "4"),
    ]))
    .unwrap();
    assert_eq!(s.bind_device(DeviceKind::Cpu, 0).unwrap(), Device::CPU);
    assert_eq!(
        s.bind_device(DeviceKind::Cuda, 4).unwrap(),
        Device::new(DeviceKind::Cuda, 3)
    );
    let e = s.bind_device(DeviceKind::Cuda, 2).unwrap_err();
    assert!(e.to_string().contains("ACCEL_SHARE_DEVICES"), "{e}");
    assert!(matches!(
        s.bind_device(DeviceKind::Cuda, 0).unwrap_err().kind(),
        ErrorKind::Unavailable
    ));
    s.share_devices = true;
    assert_eq!(
        s.bind_device(DeviceKind::Cuda, 2).unwrap(),
        Device::new(DeviceKind::Cuda, 1)
    );
}

#[test]
fn a_threads_process_numbers_its_rank_threads_from_its_first_rank() {
    let s = ProcessState::from_vars(vars(&[
        ("RANK", "4"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "0"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("ACCEL_PROCESS_MODEL", "threads"),
    ]))
    .unwrap();
    assert_eq!(s.ranks_in_process(), 4);
    let t = s.rank_thread(3).unwrap();
    assert_eq!((t.rank, t.local_rank, t.world_size), (7, 3, 8));
    assert!(s.rank_thread(4).is_err());
    // A process whose rank threads would run past WORLD_SIZE.
    let s = ProcessState::from_vars(vars(&[
        ("RANK", "6"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "0"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("ACCEL_PROCESS_MODEL", "threads"),
    ]))
    .unwrap();
    let e = s.rank_thread(0).unwrap_err();
    assert!(e.to_string().contains("WORLD_SIZE=8"), "{e}");
    // The processes model: one rank per process.
    let s = ProcessState::from_vars(vars(&[("RANK", "1"), ("WORLD_SIZE", "2")])).unwrap();
    assert_eq!(
        (s.process_model, s.ranks_in_process()),
        (ProcessModel::Processes, 1)
    );
}

#[test]
fn split_range_is_contiguous_and_balanced() {
    for world in 1..6 {
        for len in 0..20 {
            let mut next = 0;
            for r in 0..world {
                let g = split_range(r, world, len);
                assert_eq!(g.start, next);
                assert!(g.len() == len / world || g.len() == len / world + 1);
                assert_eq!(g.len() == len / world + 1, r < len % world);
                next = g.end;
            }
            assert_eq!(next, len);
        }
    }
}

#[test]
fn mpirun_or_srun_alone_needs_no_store_until_one_is_used() {
    for kv in [
        &[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2")][..],
        &[("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2")][..],
    ] {
        let s = ProcessState::from_vars(vars(kv)).unwrap();
        let store = s.open_store().unwrap();
        let e = store.set("k", b"v").unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::InvalidConfig), "{e}");
        assert!(e.to_string().contains("MASTER_ADDR"), "{e}");
        assert_eq!(e.rank(), Some(1));
    }
    // A launcher that is not MPI's still needs the store named.
    let s = ProcessState::from_vars(vars(&[("RANK", "0"), ("WORLD_SIZE", "2")])).unwrap();
    assert!(s.open_store().is_err());
}

#[test]
fn multi_process_needs_a_store() {
    let s = ProcessState::from_vars(vars(&[("RANK", "0"), ("WORLD_SIZE", "2")])).unwrap();
    assert!(s
        .store_location()
        .unwrap_err()
        .to_string()
        .contains("MASTER_ADDR"));
    let s = ProcessState::from_vars(vars(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("ACCEL_STORE_URL", "file:///tmp/x"),
    ]))
    .unwrap();
    assert_eq!(s.store_location().unwrap().unwrap(), "file:///tmp/x");
}
