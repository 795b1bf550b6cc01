//! A first program on memtoken, as a newcomer writes it in a crate of their own:
//!
//! - a kernel step written once, generic over the backend, that moves bytes only through
//!   the traits [`Bytes`] and [`BytesMut`], run on the host and on the CUDA driver model;
//! - an [`Engine`] that keeps block tables of its KV cache, moved to another thread and back;
//! - `?` from memtoken's errors into `anyhow::Result` (memtoken's default features) and into
//!   `Box<dyn Error + Send + Sync>`.
//!
//! It checks what it computes and exits non-zero if anything is wrong.

use memtoken::backend::cuda::CudaBackend;
use memtoken::backend::doubles::{DriverModel, ModelConfig};
use memtoken::backend::{Backend, HostBackend};
use memtoken::kv::{BlockTable, Layout};
use memtoken::{Binding, Budget, Bytes, BytesMut, Device, Engine, Keeps, make_guard};
use std::error::Error;

/// `y[i] = a * x[i] + y[i]` over little-endian `f32`s: the kernel step, for any memory that
/// lends its bytes to the host.
fn axpy(a: f32, x: &impl Bytes, y: &mut impl BytesMut) -> Result<(), memtoken::Error> {
    let floats = |bytes: &[u8]| -> Vec<f32> {
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let mut xs = vec![0; x.byte_len()];
    let mut ys = vec![0; y.byte_len()];
    x.copy_to_host(0, &mut xs)?;
    y.copy_to_host(0, &mut ys)?;
    let out: Vec<u8> = floats(&xs)
        .iter()
        .zip(floats(&ys))
        .flat_map(|(x, y)| (a * x + y).to_le_bytes())
        .collect();
    y.copy_from_host(0, &out)?;
    Ok(())
}

/// The same step on any backend: `x = [0, 1, 2, …]`, `y = [1, 1, …]`, then `y = 2·x + y`, read
/// back. `?` goes straight into `anyhow`.
fn step<B: Backend>(binding: &Binding<'_, '_, B>) -> anyhow::Result<Vec<f32>> {
    let g = binding.device().granularity();
    let mut x = binding.reserve(g)?.commit()?;
    let mut y = binding.reserve(g)?.commit()?;
    let n = g / 4;
    let xs: Vec<u8> = (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let ys: Vec<u8> = (0..n).flat_map(|_| 1f32.to_le_bytes()).collect();
    x.copy_from_host(0, &xs)?;
    y.copy_from_host(0, &ys)?;
    axpy(2.0, &x, &mut y)?;
    let mut back = vec![0; g];
    y.copy_to_host(0, &mut back)?;
    Ok(back
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// Runs [`step`] on a device of `backend` and checks every element.
fn run_step<B: Backend>(name: &str, backend: B) -> anyhow::Result<()> {
    make_guard!(guard);
    let device = Device::new(guard, backend);
    let out = step(&device.bind(Budget::unlimited())?)?;
    let wrong = out
        .iter()
        .enumerate()
        .filter(|&(i, &y)| y != 2.0 * i as f32 + 1.0)
        .count();
    anyhow::ensure!(
        wrong == 0,
        "{name}: {wrong} of {} elements wrong",
        out.len()
    );
    println!("{name}: y = 2·x + y on {} elements, all correct", out.len());
    Ok(())
}

/// What the engine keeps: one block table per sequence.
struct Sequences;
impl Keeps<HostBackend> for Sequences {
    type Of<'e> = Vec<BlockTable<'e, 'e, 'e, 'e, HostBackend>>;
}

/// An engine made here keeps three sequences' block tables, moves to a worker thread that
/// extends them, and comes back; its blocks keep their bytes. `?` into a boxed error.
fn engine_on_a_thread() -> Result<(), Box<dyn Error + Send + Sync>> {
    // 64 blocks of 16 tokens, one plane of 1 KiB a block.
    let layout = Layout::new(64, 16).plane(1024);
    let mark = |seq: usize, position: usize| (seq * 16 + position) as u8;
    let mut engine = Engine::<HostBackend, Sequences>::new(
        HostBackend::with_defaults()?,
        Budget::unlimited(),
        &layout,
        |parts| {
            parts.cache.set_watermarks(4, 8);
            parts.cache.replenish()?;
            let mut tables = Vec::new();
            for seq in 0..3 {
                let mut table = parts.cache.table();
                parts.cache.push(&mut table)?;
                table.write(0, 0, 0, &[mark(seq, 0)])?;
                tables.push(table);
            }
            Ok(tables)
        },
    )?;
    let worker = std::thread::spawn(move || -> Result<_, memtoken::Error> {
        engine.with(|parts, tables| -> Result<(), memtoken::Error> {
            for (seq, table) in tables.iter_mut().enumerate() {
                parts.cache.push(table)?;
                table.write(0, 1, 0, &[mark(seq, 1)])?;
            }
            Ok(())
        })?;
        Ok(engine)
    });
    let mut engine = worker.join().map_err(|_| "the worker panicked")??;
    engine.with(|_, tables| -> Result<(), Box<dyn Error + Send + Sync>> {
        for (seq, table) in tables.iter().enumerate() {
            for position in 0..2 {
                let mut byte = [0];
                table.read(0, position, 0, &mut byte)?;
                if byte[0] != mark(seq, position) {
                    return Err(format!("sequence {seq}, block {position}: {}", byte[0]).into());
                }
            }
        }
        println!(
            "an engine keeping {} block tables went to a thread and back",
            tables.len()
        );
        Ok(())
    })?;
    let report = engine.close();
    if !report.is_clean() {
        return Err(format!("the engine left {report:?}").into());
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    run_step("host", HostBackend::with_defaults()?)?;
    let model = DriverModel::new(ModelConfig::default())?;
    run_step("CUDA driver model", CudaBackend::new(model, 0)?)?;
    engine_on_a_thread().map_err(|e| anyhow::anyhow!(e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The program runs to the end: every check in it holds.
    #[test]
    fn runs() {
        super::main().unwrap();
    }
}
