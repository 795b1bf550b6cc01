//! Test doubles: backends and drivers a user's tests run memtoken's typed layer on, never
//! shipped to a GPU — in one place, apart from the backends a program uses.
//! Guide: [`guide::backends`](crate::guide::backends).
//!
//! - [`SimBackend`]: a pure-Rust strict model of the VMM rules that refuses any illegal call and
//!   records it (or, made [`strict`](SimBackend::strict), panics at it); its fences can be held
//!   and its context lost.
//! - [`Faulty`]: a wrapper around any backend that fails the Nth call of a kind
//!   ([`FaultHandle`]) and counts what is outstanding ([`Outstanding`]).
//! - [`DriverModel`]: the CUDA driver's VMM rules, events, captures, peers and context loss in
//!   pure Rust, for [`CudaBackend`](super::cuda::CudaBackend) on any machine ([`ModelConfig`]).

pub(in crate::backend) mod faults;
mod faulty;
mod sim;

pub use super::cuda::model::{CaptureMode, DriverModel, ModelConfig, ModelOutstanding, Placement};
pub use faulty::{FaultHandle, Faulty, Outstanding};
pub use sim::{SimBackend, SimCall, SimConfig, SimPhys};
