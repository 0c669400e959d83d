//! Host bindings for the `idem:plugin/job-plugin` world (generated from `wit/`).
// The export is called asynchronously, so a long call yields to the async
// worker that runs it every epoch tick; the imports stay synchronous.
wasmtime::component::bindgen!({
    world: "job-plugin",
    path: "../wit",
    exports: { default: async },
});
