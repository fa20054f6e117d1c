
#[test]
fn models_built_from_tch_layers_dispatch_too() {
    // tch's own layers initialise their variables; dispatch replaces them.
    let tmp = tempfile::tempdir().unwrap();
    tch::manual_seed(3);
    let src = VarStore::new(Device::Cpu);
    let fc1 = tch::nn::linear(src.root() / "fc1", 8, 16, Default::default());
    let fc2 = tch::nn::linear(src.root() / "fc2", 16, 4, Default::default());
    let x = input();
    let want = {
        use tch::nn::Module;
        fc2.forward(&fc1.forward(&x).relu())
    };
    let ck = tmp.path().join("model.safetensors");
    let vars = src.variables();
    let mut names: Vec<&String> = vars.keys().collect();
    names.sort();
    let data: Vec<(String, TensorMeta, Vec<u8>)> = names
        .iter()
        .map(|n| {
            let t = &vars[*n];
            let meta = TensorMeta {
                dtype: DType::F32,
                shape: t.size().iter().map(|&d| d as usize).collect(),
            };
            (n.to_string(), meta, bytes_of(t))
        })
        .collect();
    write_file(&ck, data.iter().map(|(n, m, b)| (n.as_str(), m, b.as_slice()))).unwrap();

    let vs = VarStore::new(Device::Cpu);
    let g1 = tch::nn::linear(vs.root() / "fc1", 8, 16, Default::default());
    let g2 = tch::nn::linear(vs.root() / "fc2", 16, 4, Default::default());
    let spec = ModelSpec::new().block("fc1", Some("Linear")).block("fc2", Some("Linear"));
    let d = load_checkpoint_and_dispatch(&vs, &spec, &ck, &opts(Some("disk"))).unwrap();
    assert_eq!(g1.ws.numel(), 0, "an offloaded layer holds nothing between passes");
    let mut h = Some(x.shallow_clone());
    d.run(|i, _| {
        use tch::nn::Module;
        let y = h.take().unwrap();
        h = Some(if i == 0 { g1.forward(&y).relu() } else { g2.forward(&y) });
        Ok(())
    })
    .unwrap();
    let diff = (h.unwrap() - want).abs().max().double_value(&[]);
    assert_eq!(diff, 0.0);
}
