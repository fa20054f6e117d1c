//! One rank of a conformance run: [`accel_conformance::worker`] over the
//! whole scenario library.

fn main() -> std::process::ExitCode {
    accel_conformance::worker::main()
}
