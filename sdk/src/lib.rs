//! Write an [idem](https://example.invalid/idem) plugin as one plain Rust function.
//!
//! A plugin turns a job into a list of [`Effect`]s, each carrying a stable
//! [`IdempotencyKey`]. The idem host carries the effects out, retries them and
//! makes sure each business effect happens once however often the job is
//! delivered. Plugins never perform side effects themselves and never see
//! wit-bindgen.
//!
//! A plugin declares the providers it uses (and the plugins it enqueues)
//! next to its code; the declaration travels inside the component, and the
//! host refuses any effect outside it. An operator file beside the `.wasm`
//! may narrow it, never widen it.
//!
//! ```no_run
//! use idem_sdk::{plugin, key, Effect, Email, Job, JobError};
//! use serde::Deserialize;
//!
//! #[derive(Deserialize)]
//! struct Invoice { invoice_id: u64, recipient: String }
//!
//! #[plugin(providers = ["email"])]
//! fn handle(job: Job<Invoice>) -> Result<Vec<Effect>, JobError> {
//!     let invoice = job.payload;
//!     let email = Email::to(&invoice.recipient)?
//!         .subject(format!("Invoice {}", invoice.invoice_id))
//!         .text("Your invoice is attached.");
//!     Ok(vec![Effect::email(key!("invoice:{}:email:v1", invoice.invoice_id)?, email)])
//! }
//! # fn main() {}
//! ```
//!
//! # Layout
//! - [`job`]: the delivered job with its typed payload ([`Job::for_test`] for unit tests).
//! - [`effect`]: effects and their builders (email, HTTP, child job, custom).
//! - [`key`]: idempotency keys, formatted and validated.
//! - [`error`]: [`JobError`], retryable or permanent, with a machine-readable code.
//! - [`log`]: the `trace!` .. `error!` macros that log into the host.
//! - [`sql`]: database effects: a declared statement's name and typed parameters.
//! - [`declaration`]: what `#[plugin(providers = .., enqueues = ..)]` stores in the component.
#![deny(missing_docs)]

extern crate self as idem_sdk;

pub mod declaration;
#[cfg(feature = "guest")]
pub mod effect;
#[cfg(feature = "guest")]
pub mod error;
#[cfg(feature = "guest")]
pub mod job;
pub mod key;
#[cfg(feature = "guest")]
pub mod log;
pub mod sql;

#[cfg(feature = "guest")]
pub use effect::{ChildJob, Effect, Email, HttpRequest};
#[cfg(feature = "guest")]
pub use error::JobError;
#[cfg(feature = "guest")]
pub use idem_sdk_macro::plugin;
#[cfg(feature = "guest")]
pub use job::Job;
pub use key::{IdempotencyKey, InvalidKey, MAX_KEY_LEN};
pub use sql::SqlValue;

/// Glue used by the code that `#[plugin]` emits. Not a public API.
#[cfg(feature = "guest")]
#[doc(hidden)]
pub mod __private {
    pub use wit_bindgen;

    /// Bindings for the `idem:plugin/job-plugin` world.
    #[allow(missing_docs, clippy::too_many_arguments, unsafe_code)] // wit-bindgen's FFI glue
    pub mod bindings {
        wit_bindgen::generate!({
            path: "wit",
            world: "job-plugin",
            pub_export_macro: true,
            export_macro_name: "__export_job_plugin",
            default_bindings_module: "::idem_sdk::__private::bindings",
            runtime_path: "::idem_sdk::__private::wit_bindgen::rt",
        });
    }

    use bindings::idem::plugin::types as wit;

    /// Decodes the payload, calls the plugin function and converts the result.
    pub fn run<P, F>(job: wit::Job, handler: F) -> Result<Vec<wit::Effect>, wit::JobError>
    where
        P: serde::de::DeserializeOwned,
        F: FnOnce(crate::Job<P>) -> Result<Vec<crate::Effect>, crate::JobError>,
    {
        let job = crate::Job::decode(job).map_err(crate::JobError::into_wit)?;
        match handler(job) {
            Ok(effects) => Ok(effects.into_iter().map(crate::Effect::into_wit).collect()),
            Err(error) => Err(error.into_wit()),
        }
    }
}
