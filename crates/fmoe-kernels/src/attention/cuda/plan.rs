//! The host side of a call, pure and unit-tested: kernel choice per span, compiled widths, and
//! the tile plan of both kernels (tile descriptors, KV splits, workspace slots). See the module
//! docs of [`super::super`] for the rules.

use super::super::SeqSpan;

/// Compiled q·k and v widths: a width is padded up to the next of these (zeros in the padding).
pub(crate) const PADDED_DIMS: [usize; 6] = [16, 32, 64, 128, 192, 256];
/// Keys per key tile (`FA_KEY_TILE`).
pub(crate) const KEY_TILE: usize = 64;
/// Packed rows per decode tile; a span with at most this many (query, head) rows per kv head
/// runs on the decode kernel.
pub(crate) const DECODE_ROWS: usize = 16;
/// Packed rows per prefill warp row tile (m16); a prefill CTA has 4 warps of `16 · mi` rows.
const PREFILL_WARP_ROWS: usize = 16;
/// A KV split covers at least this many key tiles (256 keys), so its partial write and the
/// combine stay small next to the K/V it reads.
pub(crate) const MIN_KEY_TILES_PER_SPLIT: usize = 4;
/// Splits are sized to put at least this many CTAs per SM on the device.
pub(crate) const CTAS_PER_SM: usize = 2;
pub(crate) const MAX_SPLITS: usize = 64;
/// `FA_DESC_WORDS`.
pub(super) const DESC_WORDS: usize = 9;

/// Which of the two tile kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Prefill,
    Decode,
}

impl Kind {
    pub(crate) const ALL: [Kind; 2] = [Kind::Prefill, Kind::Decode];

    /// Packed rows per tile (`BM`); `mi` is the prefill kernel's row tiles per warp.
    pub(crate) fn rows(self, mi: usize) -> usize {
        match self {
            Kind::Prefill => 4 * PREFILL_WARP_ROWS * mi,
            Kind::Decode => DECODE_ROWS,
        }
    }
    /// `fa::smem_bytes(BM, DQ, DV, WARPS_N)` of the header: the operand tiles, or the
    /// epilogue's f32 staging if larger.
    pub(crate) fn smem_bytes(self, mi: usize, dq: usize, dv: usize) -> usize {
        let bm = self.rows(mi);
        let warps_n = match self {
            Kind::Prefill => 1,
            Kind::Decode => 4,
        };
        let tiles = 2 * (bm * (dq + 8) + 2 * KEY_TILE * (dq + 8) + 2 * KEY_TILE * (dv + 8));
        tiles.max(4 * warps_n * bm * (dv + 4))
    }
}

/// The kernel of a span: decode iff its packed rows (`q_len · group`) fit one decode tile.
pub(crate) fn kind_of(q_len: usize, group: usize) -> Kind {
    if q_len * group <= DECODE_ROWS {
        Kind::Decode
    } else {
        Kind::Prefill
    }
}

/// (DQ, DV): each width padded to [`PADDED_DIMS`], DQ raised to DV if smaller (only DV <= DQ is
/// compiled). `None` past 256.
pub(crate) fn padded(qk_dim: usize, v_dim: usize) -> Option<(usize, usize)> {
    let pad = |d: usize| PADDED_DIMS.iter().copied().find(|&p| p >= d);
    let (dq, dv) = (pad(qk_dim)?, pad(v_dim)?);
    Some((dq.max(dv), dv))
}

/// The prefill kernel's m16 row tiles per warp: 2 (128-row CTAs, half the shared-memory reads of
/// K and V per MMA) while both widths are at most 128; beyond, the f32 accumulators of two row
/// tiles would spill, so 1 (64-row CTAs).
pub(crate) fn prefill_mi(dq: usize, dv: usize) -> usize {
    if dq <= 128 && dv <= 128 { 2 } else { 1 }
}

/// One kernel's share of a call: tile descriptors (`DESC_WORDS` each, heaviest CTA first), the
/// largest split count, the indices of the split tiles and the workspace slots they use.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct TilePlan {
    pub desc: Vec<u32>,
    pub max_split: usize,
    pub split_tiles: Vec<u32>,
    pub slots: usize,
}

impl TilePlan {
    pub(crate) fn tiles(&self) -> usize {
        self.desc.len() / DESC_WORDS
    }
}

/// One tile before splitting: span fields, first packed row, band of key tiles.
#[derive(Clone, Copy, Debug)]
struct Tile {
    span: SeqSpan,
    row0: usize,
    kt0: usize,
    nkt: usize,
}

/// The tiles of both kernels ([`Kind::ALL`] order). Split rule: with `n` tiles over all spans,
/// `s = clamp(ceil(CTAS_PER_SM · sms / (n · kv_heads)), 1, MAX_SPLITS)`; a tile with `b` key
/// tiles in its band gets `min(s, ceil(b / MIN_KEY_TILES_PER_SPLIT))` splits. Callers validated
/// the spans; sizes are below `INDEX_LIMIT` (checked by `prepare`).
pub(crate) fn plan(
    spans: &[SeqSpan],
    group: usize,
    kv_heads: usize,
    window: Option<usize>,
    sms: usize,
    mi: usize,
) -> [TilePlan; 2] {
    let mut tiles: [Vec<Tile>; 2] = [Vec::new(), Vec::new()];
    for s in spans.iter().filter(|s| s.q_len > 0) {
        let rows = s.q_len * group;
        let kind = kind_of(s.q_len, group);
        let bm = kind.rows(mi);
        for row0 in (0..rows).step_by(bm) {
            let i_first = row0 / group;
            let i_last = ((row0 + bm).min(rows) - 1) / group;
            let hi = s.past + i_last;
            let lo = window.map_or(0, |w| (s.past + i_first + 1).saturating_sub(w));
            let kt0 = lo / KEY_TILE;
            tiles[kind as usize].push(Tile {
                span: *s,
                row0,
                kt0,
                nkt: hi / KEY_TILE - kt0 + 1,
            });
        }
    }
    let ctas = (tiles[0].len() + tiles[1].len()) * kv_heads;
    let s_max = if ctas == 0 {
        1
    } else {
        (CTAS_PER_SM * sms).div_ceil(ctas).clamp(1, MAX_SPLITS)
    };
    tiles.map(|mut list| {
        let split = |t: &Tile| s_max.min(t.nkt.div_ceil(MIN_KEY_TILES_PER_SPLIT)).max(1);
        // Heaviest CTA first: the grid runs them in the first wave.
        list.sort_by_key(|t| std::cmp::Reverse(t.nkt.div_ceil(split(t))));
        let mut p = TilePlan::default();
        for (i, t) in list.iter().enumerate() {
            let n = split(t);
            let slot = p.slots;
            if n > 1 {
                p.split_tiles.push(i as u32);
                p.slots += n;
            }
            p.max_split = p.max_split.max(n);
            p.desc.extend(
                [
                    t.span.q_start,
                    t.span.q_len,
                    t.span.kv_start,
                    t.span.past,
                    t.row0,
                    n,
                    if n > 1 { slot } else { 0 },
                    t.kt0,
                    t.nkt,
                ]
                .map(|x| x as u32),
            );
        }
        p
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(q_start: usize, q_len: usize, kv_start: usize, past: usize) -> SeqSpan {
        SeqSpan {
            q_start,
            q_len,
            kv_start,
            past,
        }
    }

    #[test]
    fn kernel_choice_follows_packed_rows() {
        assert_eq!(kind_of(1, 4), Kind::Decode);
        assert_eq!(kind_of(1, 16), Kind::Decode);
        assert_eq!(kind_of(4, 4), Kind::Decode);
        assert_eq!(kind_of(5, 4), Kind::Prefill);
        assert_eq!(kind_of(1, 32), Kind::Prefill);
        assert_eq!(kind_of(16, 1), Kind::Decode);
        assert_eq!(kind_of(17, 1), Kind::Prefill);
    }

    /// Every tile's band covers every key any of its rows may see, each split range of a tile
    /// is inside the band and the splits partition it; workspace slots are disjoint.
    #[test]
    fn plans_cover_the_visible_keys_and_split_long_contexts() {
        for window in [None, Some(1), Some(70), Some(300)] {
            for group in [1, 4, 8] {
                let spans = [
                    span(0, 300, 0, 0),
                    span(300, 1, 400, 8191),
                    span(301, 3, 9000, 100),
                    span(304, 70, 9500, 1000),
                    span(374, 0, 0, 0),
                ];
                let plans = plan(&spans, group, 8, window, 132, 2);
                let mut covered = vec![0usize; 374 * group];
                for (kind, pl) in Kind::ALL.iter().zip(&plans) {
                    let bm = kind.rows(2);
                    let mut slots = vec![false; pl.slots];
                    let mut last_work = usize::MAX;
                    for (i, d) in pl.desc.chunks(DESC_WORDS).enumerate() {
                        let d: Vec<usize> = d.iter().map(|&x| x as usize).collect();
                        let (q_start, q_len, past, row0) = (d[0], d[1], d[3], d[4]);
                        let (n, slot, kt0, nkt) = (d[5], d[6], d[7], d[8]);
                        assert_eq!(kind_of(q_len, group), *kind);
                        let rows = q_len * group;
                        for x in row0..(row0 + bm).min(rows) {
                            covered[q_start * group + x] += 1;
                            let pos = past + x / group;
                            let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                            assert!(kt0 * KEY_TILE <= lo && pos < (kt0 + nkt) * KEY_TILE);
                        }
                        // The kernel's split ranges.
                        let chunk = nkt.div_ceil(n);
                        let mut next = kt0;
                        for z in 0..n {
                            let (b, e) =
                                (kt0 + (z * chunk).min(nkt), kt0 + ((z + 1) * chunk).min(nkt));
                            assert_eq!(b, next);
                            next = e;
                        }
                        assert_eq!(next, kt0 + nkt);
                        if n > 1 {
                            assert!(pl.split_tiles.contains(&(i as u32)));
                            for s in &mut slots[slot..slot + n] {
                                assert!(!*s);
                                *s = true;
                            }
                        }
                        let work = nkt.div_ceil(n);
                        assert!(work <= last_work, "heaviest first");
                        last_work = work;
                    }
                    assert!(slots.iter().all(|&s| s));
                }
                assert!(covered.iter().all(|&c| c == 1));
            }
        }
        // Decode of 8 sequences x 4096 on 132 SMs with 8 kv heads: 5 splits of 13 key tiles.
        let spans: Vec<SeqSpan> = (0..8).map(|i| span(i, 1, i * 4096, 4095)).collect();
        let [pre, dec] = plan(&spans, 4, 8, None, 132, 2);
        assert_eq!(pre.tiles(), 0);
        assert_eq!((dec.tiles(), dec.max_split, dec.slots), (8, 5, 40));
        // The paged GPU test's decode batch, 8 x 4000 cached (kv_start: table offsets, which
        // the plan only passes through): 5 splits on 132 SMs.
        let spans: Vec<SeqSpan> = (0..8).map(|i| span(i, 1, i * 251, 4000)).collect();
        let [_, dec] = plan(&spans, 4, 8, None, 132, 2);
        assert_eq!((dec.tiles(), dec.max_split), (8, 5));
        // A 4096-token prefill has enough tiles: no split.
        let [pre, dec] = plan(&[span(0, 4096, 0, 0)], 4, 8, None, 132, 2);
        assert_eq!((pre.tiles(), pre.max_split, dec.tiles()), (128, 1, 0));
    }
}
