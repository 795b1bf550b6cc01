//! CUDA prefixes across processes, on the driver model: an exportable prefix of one
//! `CudaBackend<DriverModel>` exported as POSIX descriptors (real ones: the model backs each
//! with a socket it watches), sent over a Unix socket pair, and imported by a binding of a second
//! backend on the same model — another process, as far as the model can tell — which reads the
//! bytes back, owns nothing, and gives back its handles once.

use crate::common;
use memtoken::backend::{
    Backend, Cause, Exportable, HandleType, HostBackend, PosixFd, Shareable, Violation,
};
use memtoken::backend::{
    cuda::{CudaBackend, DriverCall},
    doubles::{DriverModel, ModelConfig},
};
use memtoken::{
    Budget, Device, make_guard, sharing::ImportError, sharing::Offer, sharing::PrefixMessage,
};
use std::os::unix::net::UnixStream;

const G: usize = common::MODEL_GRANULARITY;

#[test]
#[cfg_attr(miri, ignore = "the model's POSIX-fd export: Miri has no fstat")]
fn a_cuda_prefix_imports_through_the_model_reads_back_owns_nothing_and_goes_in_either_order() {
    for (len, importer_first) in [(G, false), (G, true), (3 * G, false), (3 * G, true)] {
        let model = common::small_model();
        make_guard!(ga);
        make_guard!(gb);
        let exporter = Device::new(ga, CudaBackend::new(model.clone(), 0).unwrap());
        let importer = Device::new(gb, CudaBackend::new(model.clone(), 0).unwrap());
        let owner = exporter.bind(Budget::unlimited()).unwrap();
        let reader = importer.bind(Budget::bytes(0)).unwrap(); // an importer owns nothing
        let bytes = common::pattern(len, 0xa5);
        let mut prefix = owner
            .reserve(len)
            .unwrap()
            .commit_prefix_exportable::<PosixFd>()
            .unwrap();
        prefix.copy_from_host(0, &bytes).unwrap().unwrap();
        let export = prefix.export().unwrap();
        assert_eq!(exporter.outstanding_exports(), 1);
        assert_eq!(model.open_shareables(), 1 + usize::from(len > G));
        assert_eq!(export.message().kind, HandleType::PosixFd);
        assert_eq!(export.message().body_offset, 0);
        assert_eq!(export.message().boundary_offset, 0);

        let (a, b) = UnixStream::pair().unwrap();
        export.send(&a).unwrap();
        let offer = Offer::recv(&b).unwrap();
        let before = model.count(DriverCall::MemImportFromShareableHandle);
        let imported = reader.import(offer).unwrap();
        let imports = model.count(DriverCall::MemImportFromShareableHandle) - before;
        assert_eq!(imports, 1 + u64::from(len > G), "one import per descriptor");
        assert_eq!(imported.len(), len);
        let mut back = vec![0u8; len];
        imported.copy_to_host(0, &mut back).unwrap();
        assert!(back == bytes, "every byte as the exporter wrote it");
        assert_eq!(reader.used(), 0);
        assert_eq!(
            importer.ledger().owned_bytes,
            0,
            "the importer owns 0 bytes"
        );
        assert_eq!(exporter.ledger().owned_bytes, len as u64);

        let before = model.count(DriverCall::MemRelease);
        if importer_first {
            imported.release().complete().unwrap();
            assert_eq!(
                model.count(DriverCall::MemRelease) - before,
                1 + u64::from(len > G),
                "each imported handle released once"
            );
            export.end();
            assert_eq!(exporter.outstanding_exports(), 0);
            prefix.release().complete().unwrap();
        } else {
            prefix.release().complete().unwrap();
            export.end();
            assert_eq!(exporter.outstanding_exports(), 0);
            // The import holds the memory (fact 27): its bytes are still there.
            let mut again = vec![0u8; len];
            imported.copy_to_host(0, &mut again).unwrap();
            assert!(again == bytes, "the import keeps the memory");
            assert_eq!(model.outstanding().physical_bytes, len);
            imported.release().complete().unwrap();
        }
        assert_eq!(model.open_shareables(), 0, "every descriptor closed");
        drop((owner, reader));
        assert!(exporter.close().is_clean());
        assert!(importer.close().is_clean());
        assert!(
            model.outstanding().is_zero(),
            "{len:#x}, importer first: {importer_first}: {:?}",
            model.outstanding()
        );
    }
}

/// A message that claims other sizes than the driver's: the importer checks the driver's size
/// against it and refuses before anything is mapped; a descriptor that names no exported
/// memory is an error value, never a panic.
#[test]
#[cfg_attr(miri, ignore = "the model's POSIX-fd export: Miri has no fstat")]
fn an_import_that_disagrees_with_the_drivers_size_or_names_nothing_is_refused() {
    let model = common::small_model();
    // The exporter, below the typed layer: two exported allocations of 2G and G bytes.
    let exporter = CudaBackend::new(model.clone(), 0).unwrap();
    let big = Exportable::<PosixFd>::create_exportable(&exporter, 2 * G).unwrap();
    let small = Exportable::<PosixFd>::create_exportable(&exporter, G).unwrap();
    let plain = exporter.create(G).unwrap();
    let e = Exportable::<PosixFd>::export(&exporter, plain, G).unwrap_err();
    assert!(e.to_string().contains("not created exportable"), "{e}");
    let message = PrefixMessage {
        len: 3 * G as u64,
        body_len: 2 * G as u64,
        granularity: G as u64,
        kind: HandleType::PosixFd,
        generation: 1,
        body_offset: 0,
        boundary_offset: 0,
    };
    let export = |phys, n| {
        Exportable::<PosixFd>::export(&exporter, phys, n)
            .unwrap()
            .fd
    };

    make_guard!(guard);
    let importer = Device::new(guard, CudaBackend::new(model.clone(), 0).unwrap());
    let reader = importer.bind(Budget::bytes(0)).unwrap();
    let refused = |fds| {
        let offer =
            Offer::new(&message.encode(), fds).expect("a socket is not a file: let through");
        let e = reader.import(offer).unwrap_err();
        assert!(matches!(e, ImportError::Backend(_)), "{e}");
        e.to_string()
    };
    // The descriptors swapped: the body claims 2G of a G allocation.
    let e = refused(vec![export(small, G), export(big, 2 * G)]);
    assert!(e.contains("importing"), "{e}");
    // Both the big one: the boundary claims G of a 2G allocation.
    refused(vec![export(big, 2 * G), export(big, 2 * G)]);
    // A descriptor of nothing the driver exported.
    let null = std::fs::File::open("/dev/null").unwrap();
    refused(vec![export(big, 2 * G), null.into()]);
    // Nothing stays imported, mapped or reserved; every descriptor is closed.
    assert_eq!(importer.ledger().reserved_bytes, 0);
    assert_eq!(model.open_shareables(), 0);
    drop(reader);
    assert!(importer.close().is_clean());
    for (phys, n) in [(big, 2 * G), (small, G), (plain, G)] {
        exporter.release(phys, n).unwrap();
    }
    drop(exporter);
    assert!(model.outstanding().is_zero(), "{:?}", model.outstanding());
}

/// The host backend still refuses a descriptor that is not a file: `Offer` lets a non-file
/// through (a CUDA driver's descriptor is one), and the host's import checks it.
#[test]
#[cfg_attr(miri, ignore = "imports a memfd, which Miri lacks")]
fn a_host_import_of_a_descriptor_that_is_not_a_file_is_refused() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity() as u64;
    let message = PrefixMessage {
        len: g,
        body_len: 0,
        granularity: g,
        kind: HandleType::PosixFd,
        generation: 1,
        body_offset: 0,
        boundary_offset: 0,
    };
    let (socket, _peer) = UnixStream::pair().unwrap();
    let offer = Offer::new(&message.encode(), vec![socket.into()]).unwrap();
    let e = binding.import(offer).unwrap_err();
    // Refused by the seal check, which comes first (a socket has no seals).
    assert!(format!("{:?}", e).contains("not a sealed memfd"), "{e:?}");
    assert_eq!(device.ledger().reserved_bytes, 0);
    drop(binding);
    assert!(device.close().is_clean());
}

/// Fact 15: granularity depends on the allocation properties. On a device whose exportable
/// properties have a granularity that does not divide the device's (the one every allocation
/// is sized by), the backend still opens and plain memory and prefixes work, but exportable
/// memory — created or imported — is refused before any driver call, with an error naming
/// both granularities. An exportable granularity that divides the device's fits.
#[test]
fn exportable_memory_whose_granularity_does_not_fit_is_refused_naming_both() {
    use memtoken::backend::{Cause, Shareable, Violation};
    let model = DriverModel::new(ModelConfig {
        exportable_granularity: Some(2 * G),
        ..common::model_config()
    })
    .unwrap();
    let backend = CudaBackend::new(model.clone(), 0).unwrap();
    assert_eq!(backend.granularity(), G);
    assert_eq!(backend.exportable_granularity(), Ok(2 * G));
    let (creates, imports) = (
        model.count(DriverCall::MemCreate),
        model.count(DriverCall::MemImportFromShareableHandle),
    );
    // The whole chain of causes, as a caller reporting the error prints it.
    let both = |e: &dyn std::error::Error| {
        let e = common::messages(e).join(": ");
        assert!(e.contains(&format!("{G:#x}")), "{e}");
        assert!(e.contains(&format!("{:#x}", 2 * G)), "{e}");
        assert!(e.contains("exportable memory is refused"), "{e}");
    };
    for len in [G, 2 * G] {
        let e = Exportable::<PosixFd>::create_exportable(&backend, len).unwrap_err();
        assert!(
            matches!(
                e.cause,
                Cause::Violation(Violation::GranularityMisfit { device, exportable })
                    if device == G && exportable == 2 * G
            ),
            "{e}"
        );
        both(&e);
    }
    let fd = std::fs::File::open("/dev/null").unwrap().into();
    let e = Exportable::<PosixFd>::import(
        &backend,
        Shareable {
            fd,
            offset: 0,
            len: G,
        },
    );
    both(&e.unwrap_err());
    assert_eq!(
        model.count(DriverCall::MemCreate),
        creates,
        "refused before the driver"
    );
    assert_eq!(
        model.count(DriverCall::MemImportFromShareableHandle),
        imports
    );
    // Plain memory works on.
    let plain = backend.create(G).unwrap();
    backend.release(plain, G).unwrap();

    // Through the typed layer: the reservation comes back; a plain prefix commits.
    make_guard!(guard);
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let e = binding
        .reserve(3 * G)
        .unwrap()
        .commit_prefix_exportable::<PosixFd>()
        .unwrap_err();
    both(&e.cause);
    let reserved = match e.into_token() {
        memtoken::errors::Returned::Unchanged(reserved) => reserved,
        memtoken::errors::Returned::Quarantined(q) => {
            panic!("nothing was made to quarantine: {q:?}")
        }
    };
    let prefix = reserved.commit_prefix().unwrap();
    prefix.release().complete().unwrap();
    drop(binding);
    assert!(device.close().is_clean());
    assert!(model.outstanding().is_zero(), "{:?}", model.outstanding());

    // An exportable granularity that divides the device's fits.
    let model = DriverModel::new(ModelConfig {
        exportable_granularity: Some(G / 2),
        ..common::model_config()
    })
    .unwrap();
    let backend = CudaBackend::new(model.clone(), 0).unwrap();
    let phys = Exportable::<PosixFd>::create_exportable(&backend, G).unwrap();
    backend.release(phys, G).unwrap();
}

/// An exportable granularity the driver would not say (the query failed with an ordinary
/// error): the backend opens, plain memory works, and exportable memory is refused with the
/// query's error, before any create.
#[test]
fn a_failed_exportable_granularity_query_refuses_only_exportable_memory() {
    use memtoken::backend::Cause;
    use memtoken::backend::cuda::CuError;
    let model = common::small_model();
    // The second query of the open: the exportable properties'.
    model.fail_nth(
        DriverCall::MemGetAllocationGranularity,
        2,
        CuError::NOT_SUPPORTED,
    );
    let backend = CudaBackend::new(model.clone(), 0).unwrap();
    assert_eq!(
        backend.exportable_granularity(),
        Err(CuError::NOT_SUPPORTED)
    );
    let plain = backend.create(G).unwrap();
    let creates = model.count(DriverCall::MemCreate);
    let e = Exportable::<PosixFd>::create_exportable(&backend, G).unwrap_err();
    assert!(matches!(e.cause, Cause::Driver { code: 801, .. }), "{e}");
    assert_eq!(model.count(DriverCall::MemCreate), creates);
    backend.release(plain, G).unwrap();
}

/// Kills `src/backend/cuda/mod.rs: replace < with > in <impl Exportable<PosixFd> for
/// CudaBackend<D>>::import`: an import that claims more than the driver's allocation is "too
/// small"; one that claims less is "longer than the message claims".
#[test]
#[cfg_attr(miri, ignore = "the model's POSIX-fd export: Miri has no fstat")]
fn a_cuda_import_tells_a_short_allocation_from_a_long_one() {
    let model = common::small_model();
    let exporter = CudaBackend::new(model.clone(), 0).unwrap();
    let importer = CudaBackend::new(model.clone(), 0).unwrap();
    let small = Exportable::<PosixFd>::create_exportable(&exporter, G).unwrap();
    let big = Exportable::<PosixFd>::create_exportable(&exporter, 2 * G).unwrap();
    let claim = |phys, real, len| {
        let fd = Exportable::<PosixFd>::export(&exporter, phys, real)
            .unwrap()
            .fd;
        let handle = Shareable { fd, offset: 0, len };
        Exportable::<PosixFd>::import(&importer, handle).expect_err("the size disagrees")
    };
    let short = claim(small, G, 2 * G);
    assert!(
        matches!(
            short.cause,
            Cause::Violation(Violation::ImportTooSmall { size, len, .. })
                if size == G as u64 && len == 2 * G
        ),
        "{short}"
    );
    let long = claim(big, 2 * G, G);
    assert!(
        matches!(long.cause, Cause::Violation(Violation::Import(m)) if m.contains("longer")),
        "{long}"
    );
    for (phys, n) in [(small, G), (big, 2 * G)] {
        exporter.release(phys, n).unwrap();
    }
}
