//! The executor's protocol state machine (DESIGN §5, E1–E12).
