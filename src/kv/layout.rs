//! [`Layout`]: the planes of a KV cache, their bytes per block, and how many blocks.

use super::KvError;

/// One plane of a [`Layout`]: the bytes of one block in it, and the bytes between the starts
/// of consecutive blocks (`stride ≥ block_bytes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plane {
    /// Bytes of one block in this plane.
    pub block_bytes: usize,
    /// Bytes from one block's start to the next's: block `b` starts at `base + b × stride`.
    pub stride: usize,
}

/// The shape of a [`KvCache`](super::KvCache): its planes (each one reservation, block-major),
/// the most blocks, and the tokens a block holds (for slot mappings).
///
/// Block `b` of plane `p` is at `base(p) + b × stride(p)`: a plane is exactly the memory of a
/// block-major tensor whose first dimension is the block id. The two layouts vLLM's attention
/// backends read:
///
/// - [`per_layer`](Self::per_layer): one plane per layer, K and V inside a block — the tensor
///   `(num_blocks, 2, block_size, num_kv_heads, head_size)` (or FlashAttention's
///   `(num_blocks, num_kv_heads, block_size, 2 × head_size)`: the same bytes per block, in
///   another order inside it);
/// - [`per_layer_k_v`](Self::per_layer_k_v): one plane per layer and per K or V, each
///   `(num_blocks, block_size, num_kv_heads, head_size)`: plane `2l` is layer `l`'s K, `2l + 1`
///   its V.
///
/// Planes may differ in bytes per block (a hybrid model's layers). A **group** is then the
/// fewest blocks whose bytes fill whole granules in every plane: for a granule of `g` bytes,
/// the largest of `g / gcd(g, stride(p))` over the planes (a power of two, as `g` is). Physical
/// memory is mapped and given back a group at a time, in every plane at once.
///
/// ```
/// use memtoken::kv::Layout;
/// // 32 layers, 8 KV heads × 128 × 2 bytes, 16-token blocks, K and V in one block.
/// let layout = Layout::per_layer(32, 16, 8 * 128 * 2, 4096);
/// assert_eq!(layout.planes().len(), 32);
/// assert_eq!(layout.planes()[0].block_bytes, 2 * 16 * 8 * 128 * 2); // 64 KiB
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    planes: Vec<Plane>,
    blocks: usize,
    block_tokens: usize,
}

impl Layout {
    /// A layout of at least `blocks` blocks (the null block among them) of `block_tokens`
    /// tokens each, with no plane yet: add them with [`plane`](Self::plane).
    pub fn new(blocks: usize, block_tokens: usize) -> Self {
        Self {
            planes: Vec::new(),
            blocks,
            block_tokens,
        }
    }

    /// One plane per layer holding K and V of a block: `2 × block_tokens × token_bytes` bytes
    /// per block, where `token_bytes` is one token's K (or V) bytes in one layer
    /// (`num_kv_heads × head_size × dtype size`).
    pub fn per_layer(
        layers: usize,
        block_tokens: usize,
        token_bytes: usize,
        blocks: usize,
    ) -> Self {
        let bytes = 2usize
            .saturating_mul(block_tokens)
            .saturating_mul(token_bytes);
        (0..layers).fold(Self::new(blocks, block_tokens), |l, _| l.plane(bytes))
    }

    /// Two planes per layer, K then V, each `block_tokens × token_bytes` bytes per block.
    pub fn per_layer_k_v(
        layers: usize,
        block_tokens: usize,
        token_bytes: usize,
        blocks: usize,
    ) -> Self {
        let bytes = block_tokens.saturating_mul(token_bytes);
        (0..2 * layers).fold(Self::new(blocks, block_tokens), |l, _| l.plane(bytes))
    }

    /// Adds a plane of `block_bytes` bytes per block, blocks back to back (`stride =
    /// block_bytes`).
    pub fn plane(self, block_bytes: usize) -> Self {
        self.plane_with_stride(block_bytes, block_bytes)
    }

    /// Adds a plane of `block_bytes` bytes per block, `stride` bytes apart (padding between
    /// blocks, e.g. for alignment).
    pub fn plane_with_stride(mut self, block_bytes: usize, stride: usize) -> Self {
        self.planes.push(Plane {
            block_bytes,
            stride,
        });
        self
    }

    /// The planes, in order.
    pub fn planes(&self) -> &[Plane] {
        &self.planes
    }

    /// The blocks asked for (the cache rounds up to whole groups).
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// Checks the layout; the blocks per group for granules of `granularity` bytes, and the
    /// groups.
    pub(super) fn groups(&self, granularity: usize) -> Result<(usize, usize), KvError> {
        if self.planes.is_empty() {
            return Err(KvError::Layout("no plane: add one with Layout::plane"));
        }
        if self.blocks < 2 {
            return Err(KvError::Layout(
                "fewer than 2 blocks: block 0 is the null block",
            ));
        }
        if self.block_tokens == 0 || self.block_tokens > 1 << 31 {
            return Err(KvError::Layout(
                "a block of 0 tokens, or of more than 2^31: slots are i64",
            ));
        }
        if self.planes.iter().any(|p| p.block_bytes == 0) {
            return Err(KvError::Layout("a plane of 0 bytes per block"));
        }
        if self.planes.iter().any(|p| p.stride < p.block_bytes) {
            return Err(KvError::Layout(
                "a stride below its plane's bytes per block",
            ));
        }
        let per_group = self
            .planes
            .iter()
            .map(|p| granularity / gcd(granularity, p.stride))
            .max()
            .unwrap_or(1);
        let groups = self.blocks.div_ceil(per_group);
        let fits = groups
            .checked_mul(per_group)
            .is_some_and(|blocks| blocks <= 1 << 31)
            && self.planes.iter().all(|p| {
                p.stride
                    .checked_mul(per_group)
                    .and_then(|b| b.checked_mul(groups))
                    .is_some()
            });
        if !fits {
            return Err(KvError::Layout(
                "more than 2^31 blocks, or a plane larger than the address space: block ids are i32 for kernels",
            ));
        }
        Ok((per_group, groups))
    }
}

/// The greatest common divisor.
fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_fills_whole_granules_in_every_plane() {
        let g = 2 << 20;
        // 64 KiB per block: 32 blocks fill a 2 MiB granule.
        let l = Layout::per_layer(2, 16, 2048, 100);
        assert_eq!(l.groups(g).unwrap(), (32, 4));
        // A hybrid: 64 KiB and 24 KiB per block — 24 KiB = 3 × 8 KiB, so 256 blocks.
        let l = Layout::new(1000, 16).plane(64 << 10).plane(24 << 10);
        let (per_group, groups) = l.groups(g).unwrap();
        assert_eq!((per_group, groups), (256, 4));
        assert_eq!((per_group * (24 << 10)) % g, 0);
        // Blocks larger than a granule: one block per group.
        assert_eq!(
            Layout::new(10, 16).plane(4 << 20).groups(g).unwrap(),
            (1, 10)
        );
    }

    #[test]
    fn the_per_layer_layouts_have_a_plane_per_layer_or_two() {
        let bytes = |l: &Layout| l.planes().iter().map(|p| p.block_bytes).collect::<Vec<_>>();
        let l = Layout::per_layer(3, 16, 256, 100);
        assert_eq!(bytes(&l), [2 * 16 * 256; 3], "K and V in one plane a layer");
        let l = Layout::per_layer_k_v(3, 16, 256, 100);
        assert_eq!(bytes(&l), [16 * 256; 6], "K and V in planes of their own");
        assert_eq!((l.blocks(), l.block_tokens()), (100, 16));
    }

    #[test]
    fn a_block_of_2_to_the_31_tokens_is_the_largest_laid_out() {
        let l = Layout::new(10, 1 << 31).plane(64);
        assert_eq!(l.groups(4096).unwrap(), (64, 1));
    }

    #[test]
    fn a_layout_that_cannot_be_laid_out_is_refused() {
        let g = 4096;
        for (l, says) in [
            (Layout::new(10, 16), "no plane"),
            (Layout::new(1, 16).plane(64), "null block"),
            (Layout::new(10, 0).plane(64), "0 tokens"),
            (Layout::new(10, (1 << 31) + 1).plane(64), "2^31: slots"),
            (Layout::new(10, 16).plane(0), "0 bytes"),
            (Layout::new(10, 16).plane_with_stride(64, 32), "stride"),
            (Layout::new((1 << 31) + 1, 16).plane(64), "2^31"),
        ] {
            let e = l.groups(g).unwrap_err();
            assert!(e.to_string().contains(says), "{e}");
        }
    }
}
