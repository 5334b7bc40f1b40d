//! `millrace-supervise`: the job supervisor (E14) as a binary of its own, with nothing in it
//! but the supervisor (`supervisor.rs`, shared with `millrace supervise`).
//!
//! Why a second binary (issue 15 target 3): every job `exec`s its supervisor, and the cost of
//! an `exec` grows with the binary it maps and relocates. The full `millrace` (HTTP, SQLite,
//! TLS, PostgreSQL, CLI: ~15 MB) took ~2.5 ms a process on the benchmark machine; this one
//! is a fraction of that. The executor runs it when it finds it next to its own binary and
//! falls back to `millrace supervise` otherwise (see `shell::SupervisorProgram`).

// The supervisor module also holds what only the executor uses (the launch's builders, the
// attachment's client side, the leftover sweep): dead here, alive in `millrace`.
#[allow(dead_code)]
mod clock;
#[allow(dead_code)]
mod supervisor;

fn main() -> std::process::ExitCode {
    // The same argv as `millrace supervise`, so that a live supervisor is recognised by its
    // command line whichever binary runs it (`shell::supervisor_alive`).
    let first = std::env::args_os().nth(1);
    if first
        .as_ref()
        .is_some_and(|a| a == supervisor::PROTOCOL_QUERY)
    {
        println!("{}", supervisor::PROTOCOL);
        return std::process::ExitCode::SUCCESS;
    }
    if first.is_none_or(|a| a != supervisor::SUBCOMMAND) {
        eprintln!(
            "millrace-supervise: started by a millrace executor only (`millrace-supervise {}`, the launch on stdin)",
            supervisor::SUBCOMMAND
        );
        return std::process::ExitCode::from(2);
    }
    if std::env::args_os()
        .nth(2)
        .is_some_and(|a| a == supervisor::ZYGOTE)
    {
        return supervisor::zygote_main();
    }
    supervisor::main()
}
