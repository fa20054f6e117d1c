//! One table per field-less enum of the plugin C ABI: its lower-case name,
//! its stable numeric code (never reused) and the code's inverse.

/// `name()`, `code()`, `from_code()` and `Display` (the name) of a
/// field-less enum, from one table of `Variant => code, "name";` rows.
macro_rules! named_codes {
    ($ty:ident, name: $name_doc:literal, { $($v:ident => $code:literal, $name:literal;)+ }) => {
        impl $ty {
            #[doc = $name_doc]
            pub const fn name(self) -> &'static str {
                match self {
                    $($ty::$v => $name,)+
                }
            }

            /// Stable numeric code used across the plugin C ABI. Never reused.
            pub const fn code(self) -> u32 {
                match self {
                    $($ty::$v => $code,)+
                }
            }

            #[doc = concat!("Inverse of [`", stringify!($ty), "::code`]; `None` for an unknown code.")]
            pub const fn from_code(code: u32) -> Option<$ty> {
                Some(match code {
                    $($code => $ty::$v,)+
                    _ => return None,
                })
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}
