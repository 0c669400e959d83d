//! What `#[plugin(..)]` writes is what the host's reader accepts.

use idem_sdk::declaration::{Declaration, SECTION};
use idem_sdk::{Effect, Job, JobError, plugin};

#[plugin(providers = ["partner", "jobs"], enqueues = ["send_invoice_email", "audit.v2"])]
fn handle(_job: Job<serde::de::IgnoredAny>) -> Result<Vec<Effect>, JobError> {
    Ok(Vec::new())
}

#[test]
fn the_macro_writes_a_declaration_the_sdk_reads() {
    let declared = Declaration::parse(&__idem_plugin_export::IDEM_PLUGIN_MANIFEST)
        .expect("the macro's declaration parses");
    assert_eq!(declared.providers, ["partner", "jobs"]);
    assert_eq!(declared.enqueues, ["send_invoice_email", "audit.v2"]);
    assert_eq!(
        declared.to_json().as_bytes(),
        &__idem_plugin_export::IDEM_PLUGIN_MANIFEST[..],
        "the SDK and the macro write the same bytes"
    );
    assert_eq!(SECTION, "idem-plugin-manifest");
}

#[test]
fn the_plugin_function_stays_callable_natively() {
    let effects = handle(Job::for_test(serde::de::IgnoredAny)).expect("no error");
    assert!(effects.is_empty());
}
