//! The `#[idem_sdk::plugin]` attribute. Use it through `idem_sdk`.
use proc_macro::TokenStream;
use quote::quote;
use syn::{FnArg, ItemFn, ReturnType, parse_macro_input};

/// Turns one plain function into an idem plugin.
///
/// Accepted form (no attribute arguments):
///
/// ```ignore
/// #[idem_sdk::plugin]
/// fn handle(job: idem_sdk::Job<MyPayload>) -> Result<Vec<idem_sdk::Effect>, idem_sdk::JobError> { .. }
/// ```
///
/// `MyPayload` is any `serde::Deserialize` type; a payload that does not decode
/// is a permanent `payload_invalid` error before the function runs. The
/// function is left as it is (so it can be unit-tested natively); the macro
/// adds a private module that exports it as the `handle` of the
/// `idem:plugin/job-plugin` world.
#[proc_macro_attribute]
pub fn plugin(attr: TokenStream, item: TokenStream) -> TokenStream {
    let attr = proc_macro2::TokenStream::from(attr);
    if !attr.is_empty() {
        return syn::Error::new_spanned(attr, "#[idem_sdk::plugin] takes no arguments")
            .to_compile_error()
            .into();
    }
    let func = parse_macro_input!(item as ItemFn);
    if let Err(error) = check_signature(&func) {
        return error.to_compile_error().into();
    }
    let name = &func.sig.ident;
    quote! {
        #func

        #[doc(hidden)]
        mod __idem_plugin_export {
            struct IdemPlugin;

            impl ::idem_sdk::__private::bindings::Guest for IdemPlugin {
                fn handle(
                    job: ::idem_sdk::__private::bindings::idem::plugin::types::Job,
                ) -> ::std::result::Result<
                    ::std::vec::Vec<::idem_sdk::__private::bindings::idem::plugin::types::Effect>,
                    ::idem_sdk::__private::bindings::idem::plugin::types::JobError,
                > {
                    ::idem_sdk::__private::run(job, super::#name)
                }
            }

            ::idem_sdk::__private::bindings::__export_job_plugin!(IdemPlugin);
        }
    }
    .into()
}

fn check_signature(func: &ItemFn) -> Result<(), syn::Error> {
    let sig = &func.sig;
    if let Some(token) = &sig.asyncness {
        return Err(syn::Error::new_spanned(
            token,
            "#[idem_sdk::plugin] functions are synchronous: remove `async`",
        ));
    }
    if !sig.generics.params.is_empty() {
        return Err(syn::Error::new_spanned(
            &sig.generics,
            "#[idem_sdk::plugin] functions cannot be generic: name the payload type, e.g. `Job<MyPayload>`",
        ));
    }
    if sig.inputs.len() != 1 {
        return Err(syn::Error::new_spanned(
            &sig.inputs,
            "#[idem_sdk::plugin] functions take exactly one argument: `job: idem_sdk::Job<Payload>`",
        ));
    }
    if let Some(FnArg::Receiver(receiver)) = sig.inputs.first() {
        return Err(syn::Error::new_spanned(
            receiver,
            "#[idem_sdk::plugin] must be a free function, not a method",
        ));
    }
    if let ReturnType::Default = sig.output {
        return Err(syn::Error::new_spanned(
            sig,
            "#[idem_sdk::plugin] functions return `Result<Vec<idem_sdk::Effect>, idem_sdk::JobError>`",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::check_signature;

    fn check(source: &str) -> Result<(), String> {
        let func: syn::ItemFn = syn::parse_str(source).expect("parses");
        check_signature(&func).map_err(|e| e.to_string())
    }

    #[test]
    fn the_accepted_form() {
        assert!(
            check("fn handle(job: Job<P>) -> Result<Vec<Effect>, JobError> { todo!() }").is_ok()
        );
    }

    #[test]
    fn each_wrong_form_names_the_attribute_and_the_fix() {
        for (source, says) in [
            ("async fn h(job: Job<P>) -> R { todo!() }", "remove `async`"),
            ("fn h<T>(job: Job<T>) -> R { todo!() }", "cannot be generic"),
            ("fn h() -> R { todo!() }", "exactly one argument"),
            ("fn h(a: A, b: B) -> R { todo!() }", "exactly one argument"),
            (
                "fn h(job: Job<P>) { }",
                "return `Result<Vec<idem_sdk::Effect>",
            ),
        ] {
            let error = check(source).expect_err(source);
            assert!(error.contains("#[idem_sdk::plugin]"), "{error}");
            assert!(error.contains(says), "{source}: {error}");
        }
    }
}
