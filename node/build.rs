//! Under `--cfg madsim` (issue 16) the test binary exports madsim's `getrandom` and
//! `getentropy` dynamically: Rust's std looks `getrandom` up with `dlsym`, which finds only
//! exported symbols, so without this std's `HashMap` keys come from the kernel and madsim
//! cannot seed them. The production build is untouched.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rustc-check-cfg=cfg(madsim)");
    if std::env::var_os("CARGO_CFG_MADSIM").is_some() {
        println!("cargo:rustc-link-arg=-Wl,--export-dynamic-symbol=getrandom");
        println!("cargo:rustc-link-arg=-Wl,--export-dynamic-symbol=getentropy");
    }
}
