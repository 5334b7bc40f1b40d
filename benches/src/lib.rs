//! Fixtures shared by millrace's benchmarks.
#![forbid(unsafe_code)]

use std::collections::BTreeSet;

use millrace_core::mill::{RankIndex, RankKey};
use millrace_core::NodeId;

/// A rank index of `n` executors offering `shell`, with spread-out loads; every tenth node
/// holds the label `gpu`.
pub fn fleet_index(n: usize) -> RankIndex {
    let mut idx = RankIndex::default();
    let plain = BTreeSet::new();
    let gpu: BTreeSet<String> = ["gpu".to_string()].into_iter().collect();
    for i in 0..n {
        let node = match NodeId::new(format!("exec-{i:05}")) {
            Ok(n) => n,
            Err(e) => panic!("fixture node id: {e}"),
        };
        // A deterministic spread of loads in 0..1.
        let a = ((i * 7919) % 1000) as f64 / 1000.0;
        let b = ((i * 104_729) % 1000) as f64 / 1000.0;
        let key = RankKey::new(node.clone(), [a, b].iter());
        let labels = if i % 10 == 0 { &gpu } else { &plain };
        idx.upsert(&node, labels, vec![("shell".to_string(), key)]);
    }
    idx
}
