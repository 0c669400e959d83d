//! Host bindings for the `idem:plugin/job-plugin` world (generated from `wit/`).
wasmtime::component::bindgen!({
    world: "job-plugin",
    path: "../wit",
});
