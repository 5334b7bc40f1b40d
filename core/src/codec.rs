//! Frame codec: u32 big-endian length + postcard body, 1 MiB maximum (DESIGN §3).
