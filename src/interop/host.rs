//! Host typed views: the bytes a host token lends, as `&[T]` / `&mut [T]` of a plain-old-data
//! `T`. Each goes through the token's byte slice (`as_slice`, `as_mut_slice`, ...) and
//! then [`bytemuck`]'s checked casts, so a misfit is an error value and this module has no
//! `unsafe` of its own.

use crate::allocation::Allocation;
use crate::backend::HostVisible;
use crate::error::ViewError;
use crate::sharing::{Capability, Owner};
use crate::state::{Committed, Readable};
use bytemuck::{Pod, PodCastError};

/// Why the `len` bytes at `addr` cannot be cast to `[T]`, in this crate's words.
fn misfit<T>(addr: usize, len: usize, e: PodCastError) -> ViewError {
    match e {
        PodCastError::TargetAlignmentGreaterAndInputNotAligned
        | PodCastError::AlignmentMismatch => ViewError::Alignment {
            addr,
            align: align_of::<T>(),
        },
        PodCastError::OutputSliceWouldHaveSlop | PodCastError::SizeMismatch => ViewError::Length {
            bytes: len,
            size: size_of::<T>(),
        },
    }
}

/// `bytes` as `[T]`.
pub(crate) fn cast<T: Pod>(bytes: &[u8]) -> Result<&[T], ViewError> {
    let (addr, len) = (bytes.as_ptr() as usize, bytes.len());
    bytemuck::try_cast_slice(bytes).map_err(|e| misfit::<T>(addr, len, e))
}

/// `bytes` as `[T]`, writable.
pub(crate) fn cast_mut<T: Pod>(bytes: &mut [u8]) -> Result<&mut [T], ViewError> {
    let (addr, len) = (bytes.as_ptr() as usize, bytes.len());
    bytemuck::try_cast_slice_mut(bytes).map_err(|e| misfit::<T>(addr, len, e))
}

impl<B: HostVisible, S: Readable> Allocation<'_, '_, B, S> {
    /// The memory as `T`s, read-only, borrowed from the token like
    /// [`as_slice`](Self::as_slice): `len() / size_of::<T>()` elements.
    ///
    /// ```
    /// # use memtoken::{make_guard, Budget, Device};
    /// # use memtoken::backend::HostBackend;
    /// # make_guard!(guard);
    /// # let device = Device::new(guard, HostBackend::with_defaults()?);
    /// # let binding = device.bind(Budget::unlimited())?;
    /// let mut a = binding.reserve(4096)?.commit()?;
    /// a.as_mut_slice_of::<f32>()?[..3].copy_from_slice(&[1.0, 2.0, 3.0]);
    /// assert_eq!(&a.as_slice_of::<f32>()?[..3], &[1.0, 2.0, 3.0]);
    /// assert_eq!(a.as_slice_of::<f32>()?.len(), 1024);
    /// assert!(a.as_slice_of::<[u8; 3]>().is_err()); // 4096 is no multiple of 3
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`ViewError::Length`] if the length is not a multiple of `T`'s size (or `T` is
    /// zero-sized), [`ViewError::Alignment`] if the memory is not aligned for `T`.
    pub fn as_slice_of<T: Pod>(&self) -> Result<&[T], ViewError> {
        cast(self.as_slice())
    }
}

impl<B: HostVisible> Allocation<'_, '_, B, Committed> {
    /// The memory as `T`s, read-write, borrowed mutably from the token like
    /// [`as_mut_slice`](Self::as_mut_slice).
    ///
    /// # Errors
    ///
    /// As for [`as_slice_of`](Self::as_slice_of).
    pub fn as_mut_slice_of<T: Pod>(&mut self) -> Result<&mut [T], ViewError> {
        cast_mut(self.as_mut_slice())
    }
}

impl<B: HostVisible, K: Capability> Allocation<'_, '_, B, Owner<K>> {
    /// The prefix as `T`s, writable — only while no sharer maps it (`None` otherwise), as for
    /// [`as_mut_slice`](Allocation::as_mut_slice).
    ///
    /// # Errors
    ///
    /// As for [`as_slice_of`](Self::as_slice_of).
    pub fn as_mut_slice_of<T: Pod>(&mut self) -> Option<Result<&mut [T], ViewError>> {
        self.as_mut_slice().map(cast_mut)
    }
}

impl<B: HostVisible> Allocation<'_, '_, B, crate::region::Elastic> {
    /// The region's committed part as `T`s, read-only, borrowed from the region like
    /// [`as_slice`](Allocation::as_slice): it cannot shrink meanwhile.
    ///
    /// ```
    /// # use memtoken::{make_guard, Budget, Device};
    /// # use memtoken::backend::HostBackend;
    /// # make_guard!(guard);
    /// # let device = Device::new(guard, HostBackend::with_defaults()?);
    /// # let binding = device.bind(Budget::unlimited())?;
    /// let g = device.granularity();
    /// let mut region = binding.reserve(4 * g)?.into_region();
    /// region.grow(1)?;
    /// region.as_mut_slice_of::<u32>()?[0] = 7;
    /// assert_eq!(region.as_slice_of::<u32>()?.len(), g / 4);
    /// assert_eq!(region.as_slice_of::<u32>()?[0], 7);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As for [`Allocation::as_slice_of`].
    pub fn as_slice_of<T: Pod>(&self) -> Result<&[T], ViewError> {
        cast(self.as_slice())
    }

    /// The region's committed part as `T`s, writable, borrowed mutably from the region.
    ///
    /// # Errors
    ///
    /// As for [`Allocation::as_slice_of`].
    pub fn as_mut_slice_of<T: Pod>(&mut self) -> Result<&mut [T], ViewError> {
        cast_mut(self.as_mut_slice())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 16 bytes aligned to 8, to cut misaligned and odd-length pieces from.
    fn buffer() -> [u64; 2] {
        [0x0807_0605_0403_0201, 0x100f_0e0d_0c0b_0a09]
    }

    #[test]
    fn a_whole_number_of_aligned_elements_casts() {
        let words = buffer();
        let bytes: &[u8] = bytemuck::cast_slice(&words);
        let u32s = cast::<u32>(bytes).unwrap();
        assert_eq!(u32s.len(), 4);
        assert_eq!(u32s[0], u32::from_ne_bytes([1, 2, 3, 4]));
        assert_eq!(cast::<[u8; 8]>(bytes).unwrap().len(), 2);
    }

    #[test]
    fn an_odd_length_is_a_length_error_naming_the_bytes_and_the_size() {
        let words = buffer();
        let bytes: &[u8] = bytemuck::cast_slice(&words);
        assert_eq!(
            cast::<u32>(&bytes[..6]),
            Err(ViewError::Length { bytes: 6, size: 4 })
        );
        assert_eq!(
            cast::<[u8; 3]>(bytes),
            Err(ViewError::Length { bytes: 16, size: 3 })
        );
        assert_eq!(
            cast::<()>(bytes),
            Err(ViewError::Length { bytes: 16, size: 0 })
        );
    }

    #[test]
    fn a_misaligned_start_is_an_alignment_error_naming_the_address() {
        let words = buffer();
        let bytes: &[u8] = bytemuck::cast_slice(&words);
        let odd = &bytes[1..9];
        assert_eq!(
            cast::<u64>(odd),
            Err(ViewError::Alignment {
                addr: odd.as_ptr() as usize,
                align: 8
            })
        );
    }

    #[test]
    fn the_writable_cast_checks_the_same_and_writes_through() {
        let mut words = buffer();
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut words);
        let addr = bytes[1..].as_ptr() as usize;
        assert_eq!(
            cast_mut::<u32>(&mut bytes[1..5]),
            Err(ViewError::Alignment { addr, align: 4 })
        );
        assert_eq!(
            cast_mut::<u32>(&mut bytes[..7]),
            Err(ViewError::Length { bytes: 7, size: 4 })
        );
        cast_mut::<u32>(bytes).unwrap()[1] = u32::MAX;
        assert_eq!(&bytes[4..8], &[0xff; 4]);
    }
}
