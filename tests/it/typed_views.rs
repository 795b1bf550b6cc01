//! Host typed views: every host token that lends bytes lends them as `&[T]` / `&mut [T]` of a
//! plain-old-data `T`, with the length in `T`s, and refuses a misfit with an error value.

use memtoken::{Budget, Device, errors::ViewError, make_guard};

#[test]
fn a_committed_allocation_lends_its_bytes_as_floats_and_back() {
    make_guard!(guard);
    let device = Device::new(guard, crate::common::host());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut a = binding.reserve(4096).unwrap().commit().unwrap();
    let len = a.len();
    let floats = a.as_mut_slice_of::<f32>().unwrap();
    assert_eq!(floats.len(), len / 4, "the length is in elements");
    for (i, v) in floats.iter_mut().enumerate() {
        *v = i as f32 * 0.5;
    }
    // The same memory, as bytes and as another type.
    assert_eq!(&a.as_slice()[4..8], &0.5f32.to_ne_bytes());
    let words = a.as_slice_of::<u32>().unwrap();
    assert_eq!(words[3], 1.5f32.to_bits());
    assert_eq!(
        a.as_slice_of::<[f32; 4]>().unwrap()[1],
        [2.0, 2.5, 3.0, 3.5]
    );
    assert_eq!(a.as_slice_of::<u8>().unwrap(), a.as_slice());
}

/// A region lends its committed part as `T`s: the view's length follows the
/// region's growth and shrink, the bytes written as `T`s are read back as bytes, and a misfit
/// is an error.
#[test]
fn a_region_lends_its_committed_part_as_typed_views() {
    make_guard!(guard);
    let device = Device::new(guard, crate::common::host());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let mut region = binding.reserve(4 * g).unwrap().into_region();
    assert!(
        region.as_slice_of::<u64>().unwrap().is_empty(),
        "nothing committed"
    );
    region.grow(2).unwrap();
    let words = region.as_mut_slice_of::<u64>().unwrap();
    assert_eq!(words.len(), 2 * g / 8);
    words[g / 8] = 0x0102_0304_0506_0708; // the first word of the second granule
    assert_eq!(
        &region.as_slice()[g..g + 8],
        &0x0102_0304_0506_0708u64.to_ne_bytes()
    );
    region.shrink(1).unwrap();
    assert_eq!(region.as_slice_of::<u64>().unwrap().len(), g / 8);
    assert!(matches!(
        region.as_slice_of::<[u8; 3]>(),
        Err(ViewError::Length { .. })
    ));
}

#[test]
fn an_element_that_does_not_divide_the_length_is_a_length_error() {
    make_guard!(guard);
    let device = Device::new(guard, crate::common::host());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut a = binding.reserve(4096).unwrap().commit().unwrap();
    let bytes = a.len();
    let misfit = ViewError::Length { bytes, size: 3 };
    assert_eq!(a.as_slice_of::<[u8; 3]>().unwrap_err(), misfit);
    assert_eq!(a.as_mut_slice_of::<[u8; 3]>().unwrap_err(), misfit);
    let zero = ViewError::Length { bytes, size: 0 };
    assert_eq!(a.as_slice_of::<()>().unwrap_err(), zero);
    // Refusing lent nothing: the token is as usable as before.
    a.as_mut_slice_of::<u16>().unwrap()[0] = 7;
    assert_eq!(a.as_slice()[..2], 7u16.to_ne_bytes());
}

#[test]
#[cfg_attr(
    miri,
    ignore = "one memory at two addresses: the heap store (Miri's) maps none twice"
)]
fn the_readable_prefix_states_lend_typed_views_of_the_shared_bytes() {
    make_guard!(guard);
    let device = Device::new(guard, crate::common::host());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let mut prefix = binding.reserve(2 * g).unwrap().commit_prefix().unwrap();
    let words = prefix
        .as_mut_slice_of::<u32>()
        .expect("no sharer yet")
        .unwrap();
    words.fill(0xabcd);
    assert_eq!(prefix.as_slice_of::<u32>().unwrap().len(), 2 * g / 4);
    let sharer = binding.reserve(2 * g).unwrap().map_prefix(&prefix).unwrap();
    assert!(
        sharer
            .as_slice_of::<u32>()
            .unwrap()
            .iter()
            .all(|&w| w == 0xabcd)
    );
    let mut diverged = sharer.diverge().unwrap();
    diverged.boundary_mut().fill(0);
    let words = diverged.as_slice_of::<u32>().unwrap();
    assert_eq!(words[0], 0xabcd, "the shared body");
    assert_eq!(words[words.len() - 1], 0, "the private granule");
    assert_eq!(
        diverged.as_slice_of::<[u8; 3]>().unwrap_err(),
        ViewError::Length {
            bytes: 2 * g,
            size: 3
        }
    );
}

#[test]
fn a_view_error_says_what_misfit_and_with_which_numbers() {
    let length = ViewError::Length { bytes: 6, size: 4 }.to_string();
    assert!(
        length.contains("6 bytes") && length.contains("4-byte"),
        "{length}"
    );
    let align = ViewError::Alignment {
        addr: 0x1004,
        align: 8,
    }
    .to_string();
    assert!(
        align.contains("0x1004") && align.contains("8 bytes"),
        "{align}"
    );
    // Through `?` into the crate's `Error`, the summary comes first, then the detail.
    let e = memtoken::Error::from(ViewError::Length { bytes: 6, size: 4 });
    crate::common::says_first(&e, "the view could not be made: ");
    assert!(e.to_string().ends_with(&length), "{e}");
}

/// Code generic over the backend moves a token's bytes with one shape on every backend —
/// `copy_from_host` and `copy_to_host` on a committed allocation and a region's committed part,
/// and the same through the traits `Bytes` and `BytesMut` — the host and the CUDA driver model
/// alike. Fails if a copy lands at another offset or in another token, or a trait method
/// reaches other bytes than the token's own.
#[test]
fn generic_code_moves_a_tokens_bytes_the_same_way_on_every_backend() {
    use memtoken::backend::Backend;
    use memtoken::{Bytes, BytesMut};
    /// Writes `[7, 8]` at the last two bytes and reads the last four back.
    fn tail<T: BytesMut>(bytes: &mut T) -> [u8; 4] {
        let end = bytes.byte_len();
        bytes.copy_from_host(end - 2, &[7, 8]).unwrap();
        let mut back = [0; 4];
        Bytes::copy_to_host(bytes, end - 4, &mut back).unwrap();
        back
    }
    fn round_trip<B: Backend>(binding: &memtoken::Binding<'_, '_, B>) {
        let g = binding.device().granularity();
        let mut a = binding.reserve(2 * g).unwrap().commit().unwrap();
        a.copy_from_host(g - 2, &[1, 2, 3, 4]).unwrap();
        let mut back = [0; 6];
        a.copy_to_host(g - 3, &mut back).unwrap();
        assert_eq!(back, [0, 1, 2, 3, 4, 0]);
        let mut region = binding.reserve(4 * g).unwrap().into_region();
        region.grow(2).unwrap();
        region.copy_from_host(g, &[9; 3]).unwrap();
        let mut back = [0; 3];
        region.copy_to_host(g, &mut back).unwrap();
        assert_eq!(back, [9; 3]);
        assert_eq!((a.byte_len(), region.byte_len()), (2 * g, 2 * g));
        assert_eq!(tail(&mut a), [0, 0, 7, 8]);
        assert_eq!(tail(&mut region), [0, 0, 7, 8]);
        let mut back = [0; 3];
        region.copy_to_host(2 * g - 3, &mut back).unwrap();
        assert_eq!(
            back,
            [0, 7, 8],
            "the region's committed part ends at 2 granules"
        );
        drop((a, region));
    }
    make_guard!(guard);
    let device = Device::new(guard, crate::common::host());
    round_trip(&device.bind(Budget::unlimited()).unwrap());
    let model = crate::common::model();
    make_guard!(guard);
    let device = Device::new(guard, crate::common::cuda(&model));
    round_trip(&device.bind(Budget::unlimited()).unwrap());
}
