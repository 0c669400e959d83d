//! The `idem` binary. See `idem --help`; exit codes are documented in `idem::cli`.

fn main() {
    idem::cli::main()
}
