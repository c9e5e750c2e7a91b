use std::fmt;

use crate::{Result, size::checked_product};

/// Dimensions of a row-major tensor.
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct Shape(Vec<usize>);

impl Shape {
    pub fn dims(&self) -> &[usize] {
        &self.0
    }
    pub fn rank(&self) -> usize {
        self.0.len()
    }
    /// The number of elements, saturating at `usize::MAX` where the product overflows (so it
    /// never wraps to a small count; no buffer of `usize::MAX` elements exists, so such a shape
    /// matches no storage). Shapes built from outside input are checked with
    /// [`Shape::checked_elem_count`] first.
    pub fn elem_count(&self) -> usize {
        if self.0.contains(&0) {
            return 0;
        }
        self.0.iter().fold(1usize, |acc, &d| acc.saturating_mul(d))
    }

    /// The number of elements, or [`crate::Error::SizeOverflow`] naming the shape and its dims.
    pub fn checked_elem_count(&self) -> Result<usize> {
        let names: Vec<String> = (0..self.0.len()).map(|i| format!("dim {i}")).collect();
        let factors: Vec<(&str, usize)> = names
            .iter()
            .map(String::as_str)
            .zip(self.0.iter().copied())
            .collect();
        checked_product(&format!("elements of shape {self}"), &factors)
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl From<Vec<usize>> for Shape {
    fn from(v: Vec<usize>) -> Self {
        Shape(v)
    }
}

impl From<&[usize]> for Shape {
    fn from(v: &[usize]) -> Self {
        Shape(v.to_vec())
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(v: [usize; N]) -> Self {
        Shape(v.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn element_counts_never_wrap() {
        let s = Shape::from([1usize << 58, 64]);
        // The unchecked product wraps to 0: the old elem_count let such a shape pass as empty.
        assert_eq!((1usize << 58).wrapping_mul(64), 0);
        assert_eq!(s.elem_count(), usize::MAX);
        let e = s.checked_elem_count().unwrap_err().to_string();
        assert!(
            e.contains(&format!("dim 0 {} × dim 1 64", 1usize << 58)),
            "{e}"
        );
        assert_eq!(Shape::from([3, 4, 5]).checked_elem_count().unwrap(), 60);
        assert_eq!(Shape::from([usize::MAX, 2, 0]).elem_count(), 0);
        assert_eq!(
            Shape::from([usize::MAX, 2, 0])
                .checked_elem_count()
                .unwrap(),
            0
        );
        assert_eq!(Shape::from(Vec::new()).elem_count(), 1);
    }
}
