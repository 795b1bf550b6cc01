// Brand mismatch, stated generically: a quarantined token of brand 'a cannot be discharged with
// a proof of brand 'b, even one that outlives 'a (`ContextLost` is invariant over its brand).
use memtoken::backend::doubles::SimBackend;
use memtoken::{report::ContextLost, report::Quarantined};

fn mix<'a, 'b: 'a>(token: Quarantined<'_, 'a, SimBackend>, proof: &ContextLost<'b>) {
    let _ = token.discharge(proof);
}

fn main() {}
