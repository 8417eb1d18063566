fn main() {
    std::process::exit(cockpit::cli::main());
}
