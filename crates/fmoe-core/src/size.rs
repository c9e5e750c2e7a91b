//! Checked size arithmetic. Every size that comes from outside the program (a config field, a
//! checkpoint header, a command-line flag) goes through [`checked_product`] / [`checked_sum`]
//! before it sizes anything, so an overflow is an [`Error::SizeOverflow`] naming the quantity and
//! every operand, never a wrapped (too small) buffer or a panic later.

use crate::{Error, Result};

/// `f₁ × f₂ × …` of named factors (`(name, value)`), or [`Error::SizeOverflow`] naming `what`
/// and every factor. A zero factor makes the product 0 even when the others would overflow (an
/// empty tensor of huge dims holds nothing).
pub fn checked_product(what: &str, factors: &[(&str, usize)]) -> Result<usize> {
    if factors.iter().any(|&(_, v)| v == 0) {
        return Ok(0);
    }
    factors
        .iter()
        .try_fold(1usize, |acc, &(_, v)| acc.checked_mul(v))
        .ok_or_else(|| overflow(what, factors, " × "))
}

/// `t₁ + t₂ + …` of named terms, or [`Error::SizeOverflow`] naming `what` and every term.
pub fn checked_sum(what: &str, terms: &[(&str, usize)]) -> Result<usize> {
    terms
        .iter()
        .try_fold(0usize, |acc, &(_, v)| acc.checked_add(v))
        .ok_or_else(|| overflow(what, terms, " + "))
}

/// Bytes of `elems` elements of `elem_bytes` bytes each (checked), for `what`.
pub fn checked_bytes(what: &str, elems: usize, elem_bytes: usize) -> Result<usize> {
    checked_product(
        what,
        &[("elements", elems), ("bytes per element", elem_bytes)],
    )
}

fn overflow(what: &str, operands: &[(&str, usize)], op: &str) -> Error {
    let expr = operands
        .iter()
        .map(|(name, v)| {
            if name.is_empty() {
                v.to_string()
            } else {
                format!("{name} {v}")
            }
        })
        .collect::<Vec<_>>()
        .join(op);
    Error::SizeOverflow {
        what: what.to_string(),
        expr,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn products_and_sums_that_fit_are_exact() {
        assert_eq!(checked_product("x", &[("a", 3), ("b", 7)]).unwrap(), 21);
        assert_eq!(checked_product("x", &[]).unwrap(), 1);
        assert_eq!(checked_sum("x", &[("a", 3), ("b", 7)]).unwrap(), 10);
        assert_eq!(checked_bytes("x", 5, 4).unwrap(), 20);
        // A zero factor wins over an overflow of the others.
        let big = usize::MAX / 2;
        assert_eq!(
            checked_product("x", &[("a", big), ("b", big), ("c", 0)]).unwrap(),
            0
        );
    }

    #[test]
    fn overflows_name_the_quantity_and_every_operand() {
        // 2^60 heads × 16 wraps to exactly 0 in u64: the case that used to pass unnoticed.
        let heads = 1usize << 60;
        assert_eq!(heads.wrapping_mul(16), 0);
        let e = checked_product(
            "q_proj rows",
            &[("num_attention_heads", heads), ("head_dim", 16)],
        )
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("q_proj rows: "), "{e}");
        assert!(
            e.contains(&format!("num_attention_heads {heads} × head_dim 16")),
            "{e}"
        );
        assert!(e.contains("overflows"), "{e}");
        let e = checked_sum("context", &[("prompt", usize::MAX), ("max_tokens", 1)])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("prompt {} + max_tokens 1", usize::MAX)),
            "{e}"
        );
    }
}
