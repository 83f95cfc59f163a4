//! Compiles examples/proto/orders.proto for the orders_grpc example (feature `tonic`) with
//! tonic-prost-build and the protoc of the protoc-bin-vendored crate, so no protoc needs to be
//! installed. Without the feature it does nothing (and its dependencies are not built).

fn main() {
    println!("cargo::rerun-if-changed=examples/proto/orders.proto");
    println!("cargo::rerun-if-changed=build.rs");
    #[cfg(feature = "tonic")]
    orders::compile();
}

#[cfg(feature = "tonic")]
mod orders {
    pub(crate) fn compile() {
        let protoc = protoc_bin_vendored::protoc_bin_path().expect("the vendored protoc");
        let mut config = prost_build::Config::new();
        config.protoc_executable(protoc);
        tonic_prost_build::configure()
            .compile_with_config(
                config,
                &["examples/proto/orders.proto"],
                &["examples/proto"],
            )
            .expect("compile examples/proto/orders.proto");
    }
}
