//! A tensor-parallel plan (issue 39): module names mapped to styles in
//! transformers' `tp_plan` vocabulary (`"layers.*.self_attn.q_proj":
//! "colwise"`), and what each style makes of a module's parameters on the
//! mesh's `tp` dimension as a [`Layout`]: which dimension of the weight and
//! of the bias each rank holds a chunk of. A loader cuts a full checkpoint
//! by it ([`Layout::local_box`]), a saver puts the whole tensors back
//! together from the same layouts.
//!
//! | style | linear weight `[out, in]` | linear bias | embedding table `[vocab, hidden]` |
//! |---|---|---|---|
//! | `colwise`, `colwise_rep`, `local_colwise` | rows (`Shard(0)`) | `Shard(0)` | columns (`Shard(1)`) |
//! | `rowwise`, `rowwise_rep`, `local_rowwise` | columns (`Shard(1)`) | replicated | rows (`Shard(0)`, vocab parallel) |
//! | `replicate`, `local`, `gather`, `sequence_parallel` | replicated | replicated | replicated |
//!
//! `*` in a pattern matches one dotted segment (a layer number); the
//! pattern that matches with the fewest wildcards wins, then the longest.
//! A parameter is its module's name plus `.weight` or `.bias`.

use std::collections::BTreeMap;

use accel_api::{Error, Result};

use crate::placement::{Layout, Placement};

/// How a module's parameters are split over the `tp` dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpStyle {
    /// The output features split (Megatron's column-parallel linear).
    Colwise,
    /// The input features split, partial outputs summed (row-parallel).
    Rowwise,
    /// Every rank holds the whole module.
    Replicate,
}

/// What kind of module a parameter belongs to: the style's split depends
/// on it (an embedding's table is `[vocab, hidden]`, a linear layer's
/// weight `[out, in]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModuleKind {
    /// `nn.Linear`: weight `[out, in]`, bias `[out]`.
    Linear,
    /// `nn.Embedding`: table `[vocab, hidden]`.
    Embedding,
}

/// transformers' style names and what accel makes of each.
const STYLES: &[(&str, TpStyle)] = &[
    ("colwise", TpStyle::Colwise),
    ("colwise_rep", TpStyle::Colwise),
    ("local_colwise", TpStyle::Colwise),
    ("rowwise", TpStyle::Rowwise),
    ("rowwise_rep", TpStyle::Rowwise),
    ("local_rowwise", TpStyle::Rowwise),
    ("replicate", TpStyle::Replicate),
    ("local", TpStyle::Replicate),
    ("gather", TpStyle::Replicate),
    ("sequence_parallel", TpStyle::Replicate),
];

/// Rank `rank`'s part of `n` features split evenly over `tp` ranks: its
/// first feature and how many (a tensor-parallel layer's shard; `what`
/// names the layer in the error).
///
/// # Errors
/// [`accel_api::ErrorKind::InvalidArgument`] when `tp` does not divide `n`.
pub fn even_split(n: usize, tp: usize, rank: usize, what: &str) -> Result<(usize, usize)> {
    if tp == 0 || !n.is_multiple_of(tp) {
        return Err(Error::invalid_argument(
            "tensor parallel",
            format!(
                "{what} has {n} features, which {tp} tensor-parallel ranks cannot split evenly"
            ),
        )
        .with_fix("choose a tp size that divides the layer's features"));
    }
    let per = n / tp;
    Ok((rank * per, per))
}

/// Module-name patterns and their styles.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TpPlan {
    rules: Vec<(String, TpStyle)>,
}

impl TpPlan {
    /// A plan from `pattern → style name` pairs (a model's `tp_plan`).
    ///
    /// # Errors
    /// [`accel_api::ErrorKind::InvalidConfig`] naming a style accel does not
    /// know (with the ones it does), or an empty pattern.
    pub fn new<'a>(entries: impl IntoIterator<Item = (&'a str, &'a str)>) -> Result<TpPlan> {
        let mut rules = Vec::new();
        for (pattern, style) in entries {
            if pattern.trim().is_empty() {
                return Err(Error::invalid_config(
                    "tp_plan",
                    pattern,
                    "a module pattern is empty",
                ));
            }
            let Some((_, s)) = STYLES.iter().find(|(n, _)| *n == style) else {
                let known: Vec<&str> = STYLES.iter().map(|(n, _)| *n).collect();
                return Err(Error::invalid_config(
                    "tp_plan",
                    &format!("{pattern}: {style}"),
                    format!("unknown style `{style}`; accel knows {}", known.join(", ")),
                ));
            };
            rules.push((pattern.to_string(), *s));
        }
        Ok(TpPlan { rules })
    }

    /// A plan from JSON (`{"layers.*.mlp.up_proj": "colwise", ...}`, as in
    /// a model's `config.json` `base_model_tp_plan`).
    ///
    /// # Errors
    /// Malformed JSON or a value that is not a string; as [`TpPlan::new`].
    pub fn from_json(text: &str) -> Result<TpPlan> {
        let map: BTreeMap<String, String> = serde_json::from_str(text).map_err(|e| {
            Error::invalid_config("tp_plan", text, format!("not a map of strings: {e}"))
        })?;
        TpPlan::new(map.iter().map(|(k, v)| (k.as_str(), v.as_str())))
    }

    /// The style of parameter `param` (`layers.3.mlp.up_proj.weight`):
    /// the best rule matching its module; [`TpStyle::Replicate`] when none.
    pub fn style(&self, param: &str) -> TpStyle {
        let module = param
            .strip_suffix(".weight")
            .or_else(|| param.strip_suffix(".bias"))
            .unwrap_or(param);
        self.rules
            .iter()
            .filter(|(p, _)| matches(p, module))
            .min_by_key(|(p, _)| (p.matches('*').count(), usize::MAX - p.len()))
            .map_or(TpStyle::Replicate, |(_, s)| *s)
    }

    /// The layout of parameter `param` (of a `kind` module, `shape`) over a
    /// `tp`-rank dimension.
    ///
    /// # Errors
    /// A shape the style cannot split (a 1-D weight split by columns).
    pub fn layout(
        &self,
        param: &str,
        kind: ModuleKind,
        shape: &[usize],
        tp: usize,
    ) -> Result<Layout> {
        let bias = param.ends_with(".bias");
        let placement = match (self.style(param), kind, bias) {
            (TpStyle::Replicate, _, _) => Placement::Replicate,
            (TpStyle::Colwise, ModuleKind::Linear, _) => Placement::Shard { dim: 0 },
            (TpStyle::Rowwise, ModuleKind::Linear, true) => Placement::Replicate,
            (TpStyle::Rowwise, ModuleKind::Linear, false) => Placement::Shard { dim: 1 },
            (TpStyle::Colwise, ModuleKind::Embedding, _) => Placement::Shard { dim: 1 },
            (TpStyle::Rowwise, ModuleKind::Embedding, _) => Placement::Shard { dim: 0 },
        };
        Layout::new(shape.to_vec(), vec![tp], vec![placement]).map_err(|e| {
            Error::invalid_argument(
                "tp_plan",
                format!("{param} ({kind:?}, shape {shape:?}): {}", e.message()),
            )
        })
    }
}

/// A parameter as a tensor-parallel plan sees it: its name
/// (`layers.0.mlp.up_proj.weight`), its module's kind, its whole shape, and
/// the plan. What the frameworks' plan helpers (`cut_by_plan`,
/// `whole_by_plan`, ...) take.
#[derive(Clone, Copy, Debug)]
pub struct Planned<'a> {
    /// The parameter's name.
    pub name: &'a str,
    /// Its module's kind (the style's split depends on it).
    pub kind: ModuleKind,
    /// The whole tensor's shape.
    pub shape: &'a [usize],
    /// The plan.
    pub plan: &'a TpPlan,
}

impl Planned<'_> {
    /// The parameter's layout over a `tp`-rank dimension
    /// ([`TpPlan::layout`]).
    ///
    /// # Errors
    /// As [`TpPlan::layout`].
    pub fn layout(&self, tp: usize) -> Result<Layout> {
        self.plan.layout(self.name, self.kind, self.shape, tp)
    }
}

/// `pattern` matches `module` segment by segment, `*` any one segment.
fn matches(pattern: &str, module: &str) -> bool {
    let (p, m): (Vec<&str>, Vec<&str>) =
        (pattern.split('.').collect(), module.split('.').collect());
    p.len() == m.len() && p.iter().zip(&m).all(|(a, b)| *a == "*" || a == b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama() -> TpPlan {
        TpPlan::from_json(
            r#"{"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
                "layers.*.mlp.down_proj": "rowwise", "layers.0.mlp.down_proj": "replicate",
                "embed_tokens": "rowwise", "lm_head": "colwise_rep"}"#,
        )
        .unwrap()
    }

    #[test]
    fn even_split_gives_each_rank_its_run_and_refuses_a_remainder() {
        let parts: Vec<(usize, usize)> = (0..3)
            .map(|r| even_split(12, 3, r, "a layer").unwrap())
            .collect();
        assert_eq!(parts, [(0, 4), (4, 4), (8, 4)]);
        let e = even_split(7, 2, 0, "a row-parallel layer").unwrap_err();
        assert!(
            e.to_string()
                .contains("a row-parallel layer has 7 features, which 2 tensor-parallel ranks"),
            "{e}"
        );
        assert!(even_split(4, 0, 0, "a layer").is_err());
    }

    #[test]
    fn styles_follow_the_most_specific_pattern() {
        let p = llama();
        assert_eq!(
            p.style("layers.7.self_attn.q_proj.weight"),
            TpStyle::Colwise
        );
        assert_eq!(p.style("layers.7.self_attn.o_proj.bias"), TpStyle::Rowwise);
        assert_eq!(p.style("layers.7.mlp.down_proj.weight"), TpStyle::Rowwise);
        // The layer named outright beats the wildcard.
        assert_eq!(p.style("layers.0.mlp.down_proj.weight"), TpStyle::Replicate);
        assert_eq!(
            p.style("layers.7.input_layernorm.weight"),
            TpStyle::Replicate
        );
        // A wildcard is one segment.
        assert_eq!(
            p.style("layers.7.x.self_attn.q_proj.weight"),
            TpStyle::Replicate
        );
        assert_eq!(p.style("lm_head.weight"), TpStyle::Colwise);
    }

    #[test]
    fn each_style_splits_its_dimension_and_chunks_like_torch() {
        let p = llama();
        let lin = ModuleKind::Linear;
        let q = p
            .layout("layers.1.self_attn.q_proj.weight", lin, &[6, 4], 2)
            .unwrap();
        assert_eq!(q.local_box(&[1]).unwrap(), vec![3..6, 0..4]);
        let qb = p
            .layout("layers.1.self_attn.q_proj.bias", lin, &[6], 2)
            .unwrap();
        assert_eq!(qb.local_box(&[0]).unwrap(), vec![0..3]);
        let o = p
            .layout("layers.1.self_attn.o_proj.weight", lin, &[4, 6], 2)
            .unwrap();
        assert_eq!(o.local_box(&[1]).unwrap(), vec![0..4, 3..6]);
        let ob = p
            .layout("layers.1.self_attn.o_proj.bias", lin, &[4], 2)
            .unwrap();
        assert_eq!(ob.local_box(&[1]).unwrap(), vec![0..4]);
        let emb = p
            .layout("embed_tokens.weight", ModuleKind::Embedding, &[10, 3], 4)
            .unwrap();
        // ceil(10 / 4) = 3 rows each, the last rank 1.
        assert_eq!(emb.local_box(&[3]).unwrap(), vec![9..10, 0..3]);
        let norm = p.layout("norm.weight", lin, &[4], 2).unwrap();
        assert_eq!(norm.local_box(&[1]).unwrap(), vec![0..4]);
        // A 1-D weight split by columns is refused, naming it.
        let e = p
            .layout("layers.1.mlp.down_proj.weight", lin, &[4], 2)
            .unwrap_err();
        assert!(
            e.to_string().contains("layers.1.mlp.down_proj.weight"),
            "{e}"
        );
    }

    #[test]
    fn unknown_styles_and_malformed_plans_are_refused_naming_them() {
        let e = TpPlan::new([("layers.*.mlp", "diagonal")]).unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("diagonal") && m.contains("colwise") && m.contains("layers.*.mlp"),
            "{m}"
        );
        assert!(TpPlan::new([("", "colwise")]).is_err());
        assert!(TpPlan::from_json(r#"{"a": 1}"#).is_err());
        assert!(TpPlan::from_json("[").is_err());
    }
}
