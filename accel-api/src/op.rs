use std::str::FromStr;

use crate::{Error, ErrorKind};

/// How a reduction combines the contributions of all ranks.
///
/// `Avg` is the element-wise mean: engines without a native average compute a
/// sum and divide by the group size; for integer types the quotient is
/// truncated toward zero, for floating-point types it is rounded as the type
/// rounds.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise product.
    Prod,
    /// Element-wise minimum.
    Min,
    /// Element-wise maximum.
    Max,
    /// Element-wise mean (sum divided by the group size).
    Avg,
}

impl ReduceOp {
    /// Every reduction, in declaration order.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
    ];
}

named_codes!(ReduceOp, name: "Lower-case name, as accepted by [`FromStr`].", {
    Sum => 1, "sum";
    Prod => 2, "prod";
    Min => 3, "min";
    Max => 4, "max";
    Avg => 5, "avg";
});

impl FromStr for ReduceOp {
    type Err = Error;

    /// Parses `sum`, `prod`/`product`, `min`, `max`, `avg`/`mean`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for any other spelling. An unknown
    /// reduction is never silently treated as a sum.
    fn from_str(s: &str) -> Result<Self, Error> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "sum" => ReduceOp::Sum,
            "prod" | "product" => ReduceOp::Prod,
            "min" => ReduceOp::Min,
            "max" => ReduceOp::Max,
            "avg" | "mean" => ReduceOp::Avg,
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!("unknown reduction `{other}`"),
                )
                .with_fix("use one of sum, prod, min, max, avg (mean)"))
            }
        })
    }
}
