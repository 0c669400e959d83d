//! The `idem` program, built beside the whole-system tests so `tests/cli.rs`
//! runs it as a user would (`CARGO_BIN_EXE_idem-test`) without the runtime crate's
//! own tests needing the guest plugins.

fn main() {
    idem::cli::main()
}
