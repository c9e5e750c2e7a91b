use fmoe_core::{Device, Tensor};

use super::{AlignedRoutes, OP, TallRuns, mixed_blocks};
use crate::{Error, Result};

/// Counting sort by expert; stable, so routes keep ascending order inside each expert. With
/// `tall`, each expert's run is its [`mixed_blocks`] short blocks, then its tall blocks laid out
/// after every expert's short ones (the rule gives it one kind).
pub(super) fn align_routes(
    ids: &[u32],
    num_experts: usize,
    block_m: usize,
    tall: Option<usize>,
) -> Result<AlignedRoutes> {
    let num_routes = ids.len();
    let mut counts = vec![0u32; num_experts];
    for (route, &id) in ids.iter().enumerate() {
        let slot = counts.get_mut(id as usize).ok_or(Error::ExpertId {
            op: OP,
            id,
            route,
            experts: num_experts,
        })?;
        *slot += 1;
    }
    // (short, tall) blocks of each expert.
    let blocks: Vec<(usize, usize)> = counts
        .iter()
        .map(|&c| match tall {
            Some(_) => mixed_blocks(c as usize, block_m),
            None => ((c as usize).div_ceil(block_m), 0),
        })
        .collect();
    let tall_m = tall.unwrap_or(block_m);
    let prefix = |slots: &dyn Fn(usize) -> usize, base: usize| -> Vec<u32> {
        let mut v = Vec::with_capacity(num_experts + 1);
        let mut at = base;
        v.push(at as u32);
        for e in 0..num_experts {
            at += slots(e);
            v.push(at as u32);
        }
        v
    };
    let offsets = prefix(&|e| blocks[e].0 * block_m, 0);
    let short_total = offsets[num_experts] as usize;
    let tall_offsets = prefix(&|e| blocks[e].1 * tall_m, short_total);
    let end = tall_offsets[num_experts] as usize;
    let pad = num_routes as u32;
    let mut sorted = vec![pad; end];
    let mut placed = vec![0usize; num_experts];
    for (route, &id) in ids.iter().enumerate() {
        let e = id as usize;
        let (i, short_len) = (placed[e], blocks[e].0 * block_m);
        let slot = if i < short_len {
            offsets[e] as usize + i
        } else {
            tall_offsets[e] as usize + i - short_len
        };
        sorted[slot] = route as u32;
        placed[e] += 1;
    }
    let mut block_experts: Vec<u32> = (0..num_experts)
        .flat_map(|e| std::iter::repeat_n(e as u32, blocks[e].0))
        .collect();
    block_experts.extend((0..num_experts).flat_map(|e| std::iter::repeat_n(e as u32, blocks[e].1)));
    let cpu = Device::Cpu;
    let tall = match tall {
        None => None,
        Some(t) => Some(TallRuns {
            block_m: t,
            expert_offsets: Tensor::from_vec(tall_offsets, [num_experts + 1], &cpu)?,
            slot_base: short_total,
            block_base: short_total / block_m,
            total: Tensor::from_vec(vec![(end - short_total) as u32], [1], &cpu)?,
        }),
    };
    let nblocks = block_experts.len();
    Ok(AlignedRoutes {
        sorted_routes: Tensor::from_vec(sorted, [end], &cpu)?,
        block_experts: Tensor::from_vec(block_experts, [nblocks], &cpu)?,
        expert_offsets: Tensor::from_vec(offsets, [num_experts + 1], &cpu)?,
        expert_counts: Tensor::from_vec(counts, [num_experts], &cpu)?,
        total: Tensor::from_vec(vec![short_total as u32], [1], &cpu)?,
        num_routes,
        num_experts,
        block_m,
        tall,
        pending_check: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sorts_pads_and_labels_blocks() {
        // 3 tokens, top-2: routes 0..6 go to experts [2,0, 0,1, 2,0].
        let a = align_routes(&[2, 0, 0, 1, 2, 0], 4, 2, None).unwrap();
        let sorted = a.sorted_routes.cpu_slice::<u32>("t", "s").unwrap();
        // expert 0: routes 1,2,5 (+1 pad); expert 1: 3 (+1 pad); expert 2: 0,4; expert 3: none.
        assert_eq!(sorted, &[1, 2, 5, 6, 3, 6, 0, 4]);
        assert_eq!(
            a.block_experts.cpu_slice::<u32>("t", "b").unwrap(),
            &[0, 0, 1, 2]
        );
        assert_eq!(
            a.expert_offsets.cpu_slice::<u32>("t", "o").unwrap(),
            &[0, 4, 6, 8, 8]
        );
        assert_eq!(a.experts_touched().unwrap(), 3);
        assert_eq!(a.total_host().unwrap(), 8);
        a.check().unwrap();
    }

    #[test]
    fn out_of_range_expert_is_an_error() {
        let err = align_routes(&[0, 9], 4, 16, None).unwrap_err().to_string();
        assert!(
            err.contains("expert id 9") && err.contains("4 experts"),
            "{err}"
        );
    }

    #[test]
    fn mixed_tiles_put_each_expert_in_its_cheaper_segment() {
        // Tiles 2 and 3: expert 0 has 3 routes (one tall block), expert 1 has 1 (one short block,
        // padded), expert 2 has 5 (6 slots either way: two tall blocks), expert 3 none, expert 4
        // has 4 (two short blocks).
        let ids = [0, 1, 0, 2, 4, 4, 0, 2, 2, 2, 4, 4, 2];
        let a = align_routes(&ids, 5, 2, Some(3)).unwrap();
        let sorted = a.sorted_routes.cpu_slice::<u32>("t", "s").unwrap();
        let p = 13;
        // Short segment: e1 [1, pad], e4 [4, 5], [10, 11]; tall: e0 [0, 2, 6], e2 [3, 7, 8],
        // [9, 12, pad].
        assert_eq!(
            sorted,
            &[1, p, 4, 5, 10, 11, 0, 2, 6, 3, 7, 8, 9, 12, p],
            "routes by segment and expert"
        );
        assert_eq!(
            a.block_experts.cpu_slice::<u32>("t", "b").unwrap(),
            &[1, 4, 4, 0, 2, 2]
        );
        assert_eq!(
            a.expert_offsets.cpu_slice::<u32>("t", "o").unwrap(),
            &[0, 0, 2, 2, 2, 6]
        );
        assert_eq!(a.total_host().unwrap(), 6);
        let tall = a.tall.as_ref().unwrap();
        assert_eq!((tall.block_m, tall.slot_base, tall.block_base), (3, 6, 3));
        assert_eq!(tall.total.cpu_slice::<u32>("t", "t").unwrap(), &[9]);
        assert_eq!(
            tall.expert_offsets.cpu_slice::<u32>("t", "to").unwrap(),
            &[6, 9, 9, 15, 15, 15]
        );
        assert_eq!(
            a.tiling(),
            super::super::RouteTiling::Mixed { short: 2, tall: 3 }
        );
    }

    #[test]
    fn no_routes_gives_no_blocks() {
        let a = align_routes(&[], 8, 16, None).unwrap();
        assert_eq!(a.sorted_routes.elem_count(), 0);
        assert_eq!(a.block_experts.elem_count(), 0);
    }
}
