pub mod mpsc;

// millrace patch (vendor/README.md): madsim's own maps hash with fixed keys, so their
// iteration order (the sockets a killed node closes, the nodes a partition walks) follows
// only the simulation's own history. With std's `RandomState` it followed how many maps the
// simulation's thread had created before — the same seed run twice in one process (madsim's
// determinism check, or a suite of seeds) then diverged after the first kill.
pub(crate) type HashMap<K, V> =
    std::collections::HashMap<K, V, std::hash::BuildHasherDefault<std::hash::DefaultHasher>>;
pub(crate) type HashSet<K> =
    std::collections::HashSet<K, std::hash::BuildHasherDefault<std::hash::DefaultHasher>>;
