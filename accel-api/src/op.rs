use std::fmt;
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

    /// Lower-case name, as accepted by [`FromStr`].
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }

    /// Stable numeric code used across the plugin C ABI.
    pub const fn code(self) -> u32 {
        match self {
            ReduceOp::Sum => 1,
            ReduceOp::Prod => 2,
            ReduceOp::Min => 3,
            ReduceOp::Max => 4,
            ReduceOp::Avg => 5,
        }
    }

    /// Inverse of [`ReduceOp::code`].
    pub const fn from_code(code: u32) -> Option<ReduceOp> {
        Some(match code {
            1 => ReduceOp::Sum,
            2 => ReduceOp::Prod,
            3 => ReduceOp::Min,
            4 => ReduceOp::Max,
            5 => ReduceOp::Avg,
            _ => return None,
        })
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

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
