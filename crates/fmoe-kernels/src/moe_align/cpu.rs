use fmoe_core::{Device, Tensor};

use super::{AlignedRoutes, OP};
use crate::{Error, Result};

/// Counting sort by expert; stable, so routes keep ascending order inside each expert.
pub(super) fn align_routes(
    ids: &[u32],
    num_experts: usize,
    block_m: usize,
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
    let mut offsets = Vec::with_capacity(num_experts + 1);
    let mut total = 0usize;
    offsets.push(0u32);
    for &c in &counts {
        total += (c as usize).div_ceil(block_m) * block_m;
        offsets.push(total as u32);
    }
    let pad = num_routes as u32;
    let mut sorted = vec![pad; total];
    let mut cursor: Vec<usize> = offsets[..num_experts].iter().map(|&o| o as usize).collect();
    for (route, &id) in ids.iter().enumerate() {
        sorted[cursor[id as usize]] = route as u32;
        cursor[id as usize] += 1;
    }
    let mut block_experts = Vec::with_capacity(total / block_m);
    for (e, w) in offsets.windows(2).enumerate() {
        block_experts.extend(std::iter::repeat_n(
            e as u32,
            (w[1] - w[0]) as usize / block_m,
        ));
    }
    let cpu = Device::Cpu;
    Ok(AlignedRoutes {
        sorted_routes: Tensor::from_vec(sorted, [total], &cpu)?,
        block_experts: Tensor::from_vec(block_experts, [total / block_m], &cpu)?,
        expert_offsets: Tensor::from_vec(offsets, [num_experts + 1], &cpu)?,
        expert_counts: Tensor::from_vec(counts, [num_experts], &cpu)?,
        total: Tensor::from_vec(vec![total as u32], [1], &cpu)?,
        num_routes,
        num_experts,
        block_m,
        pending_check: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sorts_pads_and_labels_blocks() {
        // 3 tokens, top-2: routes 0..6 go to experts [2,0, 0,1, 2,0].
        let a = align_routes(&[2, 0, 0, 1, 2, 0], 4, 2).unwrap();
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
        let err = align_routes(&[0, 9], 4, 16).unwrap_err().to_string();
        assert!(
            err.contains("expert id 9") && err.contains("4 experts"),
            "{err}"
        );
    }

    #[test]
    fn no_routes_gives_no_blocks() {
        let a = align_routes(&[], 8, 16).unwrap();
        assert_eq!(a.sorted_routes.elem_count(), 0);
        assert_eq!(a.block_experts.elem_count(), 0);
    }
}
