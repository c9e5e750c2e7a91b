//! The standard attention block's shape (Mixtral, Llama): q/k/v projections, rotary on q and k,
//! K and V cached as two streams (`[tokens, kv_heads·head_dim]` each).

/// Shape of a standard attention block.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionSpec {
    pub hidden: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Keys at distance ≥ `sliding_window` from the query are masked.
    pub sliding_window: Option<usize>,
}
