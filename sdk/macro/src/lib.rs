//! The `#[idem_sdk::plugin]` attribute. Use it through `idem_sdk`.
use proc_macro::TokenStream;
use quote::quote;
use syn::meta::ParseNestedMeta;
use syn::{Expr, ExprLit, FnArg, ItemFn, Lit, LitStr, ReturnType, parse_macro_input};

// Kept equal to `idem_sdk::declaration` (this crate cannot depend on the SDK);
// the SDK's tests parse what this macro writes.
const SECTION: &str = "idem-plugin-manifest";
const VERSION: u32 = 1;
const MAX_NAMES: usize = 64;
const MAX_NAME_LEN: usize = 64;
const JOBS_PROVIDER: &str = "jobs";

/// Turns one plain function into an idem plugin and records what it needs.
///
/// Accepted forms:
///
/// ```ignore
/// #[idem_sdk::plugin]                         // uses no provider
/// #[idem_sdk::plugin(providers = ["email"])]  // may send email through `email`
/// #[idem_sdk::plugin(providers = ["partner", "jobs"], enqueues = ["send_invoice_email"])]
/// fn handle(job: idem_sdk::Job<MyPayload>) -> Result<Vec<idem_sdk::Effect>, idem_sdk::JobError> { .. }
/// ```
///
/// `providers` names every provider the plugin's effects use (`"jobs"` for
/// child jobs); `enqueues` names the plugins it may enqueue through `jobs`
/// (required with `"jobs"`, refused without it). Names are string literals
/// of ASCII letters, digits, `_`, `-` and `.`. The declaration is stored in
/// the component (custom section `idem-plugin-manifest`); the host refuses
/// any effect outside it, and an operator file may only narrow it.
///
/// `MyPayload` is any `serde::Deserialize` type; a payload that does not decode
/// is a permanent `payload_invalid` error before the function runs. The
/// function is left as it is (so it can be unit-tested natively with
/// `Job::for_test`); the macro adds a private module that exports it as the
/// `handle` of the `idem:plugin/job-plugin` world.
#[proc_macro_attribute]
pub fn plugin(attr: TokenStream, item: TokenStream) -> TokenStream {
    let mut args = Args::default();
    let parser = syn::meta::parser(|meta| args.parse(meta));
    parse_macro_input!(attr with parser);
    let declaration = match args.declaration() {
        Ok(json) => json,
        Err(error) => return error.to_compile_error().into(),
    };
    let func = parse_macro_input!(item as ItemFn);
    if let Err(error) = check_signature(&func) {
        return error.to_compile_error().into();
    }
    let name = &func.sig.ident;
    let bytes = proc_macro2::Literal::byte_string(declaration.as_bytes());
    let len = declaration.len();
    quote! {
        #func

        #[doc(hidden)]
        mod __idem_plugin_export {
            /// What the plugin declared, read by the host from the component.
            // `link_section` alone keeps the static (rustc treats it as
            // reachable); `#[used]` would also put a copy in the data segment.
            #[cfg_attr(target_arch = "wasm32", unsafe(link_section = #SECTION))]
            #[allow(dead_code)]
            pub static IDEM_PLUGIN_MANIFEST: [u8; #len] = *#bytes;

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

/// The attribute's arguments, each list with the key it came from (for spans).
#[derive(Default)]
struct Args {
    providers: Option<(syn::Path, Vec<LitStr>)>,
    enqueues: Option<(syn::Path, Vec<LitStr>)>,
}

impl Args {
    fn parse(&mut self, meta: ParseNestedMeta) -> syn::Result<()> {
        let (key, slot) = if meta.path.is_ident("providers") {
            ("providers", &mut self.providers)
        } else if meta.path.is_ident("enqueues") {
            ("enqueues", &mut self.enqueues)
        } else {
            let path = &meta.path;
            return Err(syn::Error::new_spanned(
                path,
                format!(
                    "unknown #[idem_sdk::plugin] argument `{}`: expected `providers = [\"...\"]` or `enqueues = [\"...\"]`",
                    quote!(#path).to_string().replace(' ', "")
                ),
            ));
        };
        if slot.is_some() {
            return Err(syn::Error::new_spanned(
                &meta.path,
                format!("#[idem_sdk::plugin] argument `{key}` is given twice"),
            ));
        }
        if !meta.input.peek(syn::Token![=]) {
            return Err(syn::Error::new_spanned(
                &meta.path,
                format!("#[idem_sdk::plugin] argument `{key}` takes a list: `{key} = [\"name\"]`"),
            ));
        }
        let value: Expr = meta.value()?.parse()?;
        let Expr::Array(array) = &value else {
            return Err(syn::Error::new_spanned(
                &value,
                format!(
                    "#[idem_sdk::plugin] argument `{key}` takes a list of string literals, e.g. `{key} = [\"name\"]`"
                ),
            ));
        };
        let mut names: Vec<LitStr> = Vec::with_capacity(array.elems.len());
        for element in &array.elems {
            let Expr::Lit(ExprLit {
                lit: Lit::Str(name),
                ..
            }) = element
            else {
                return Err(syn::Error::new_spanned(
                    element,
                    format!(
                        "#[idem_sdk::plugin] argument `{key}` takes string literals, e.g. `{key} = [\"name\"]`"
                    ),
                ));
            };
            check_name(key, name)?;
            if names.iter().any(|n| n.value() == name.value()) {
                return Err(syn::Error::new_spanned(
                    name,
                    format!(
                        "#[idem_sdk::plugin] argument `{key}` lists {:?} twice",
                        name.value()
                    ),
                ));
            }
            names.push(name.clone());
        }
        if names.len() > MAX_NAMES {
            return Err(syn::Error::new_spanned(
                array,
                format!("#[idem_sdk::plugin] argument `{key}` lists more than {MAX_NAMES} names"),
            ));
        }
        *slot = Some((meta.path.clone(), names));
        Ok(())
    }

    /// The JSON the host reads; `jobs` and `enqueues` must come together.
    fn declaration(&self) -> syn::Result<String> {
        let providers = self
            .providers
            .as_ref()
            .map_or(&[][..], |(_, n)| n.as_slice());
        let enqueues = self
            .enqueues
            .as_ref()
            .map_or(&[][..], |(_, n)| n.as_slice());
        let jobs = providers.iter().find(|p| p.value() == JOBS_PROVIDER);
        match (jobs, &self.enqueues) {
            (Some(jobs), None) => {
                return Err(syn::Error::new_spanned(
                    jobs,
                    "#[idem_sdk::plugin] provider \"jobs\" needs `enqueues = [\"plugin\", ...]` naming the plugins this plugin may enqueue",
                ));
            }
            (Some(jobs), Some(_)) if enqueues.is_empty() => {
                return Err(syn::Error::new_spanned(
                    jobs,
                    "#[idem_sdk::plugin] provider \"jobs\" needs `enqueues` to name at least one plugin",
                ));
            }
            (None, Some((path, _))) => {
                return Err(syn::Error::new_spanned(
                    path,
                    "#[idem_sdk::plugin] argument `enqueues` needs \"jobs\" in `providers`: child jobs go through the built-in jobs provider",
                ));
            }
            _ => {}
        }
        let list = |names: &[LitStr]| {
            names
                .iter()
                .map(|n| format!("\"{}\"", n.value()))
                .collect::<Vec<_>>()
                .join(",")
        };
        Ok(format!(
            r#"{{"v":{VERSION},"providers":[{}],"enqueues":[{}]}}"#,
            list(providers),
            list(enqueues)
        ))
    }
}

/// The SDK's name rule; names need no escaping in JSON because of it.
fn check_name(key: &str, name: &LitStr) -> syn::Result<()> {
    let value = name.value();
    let why = if value.is_empty() {
        Some("is empty".to_string())
    } else if value.len() > MAX_NAME_LEN {
        Some(format!("is longer than {MAX_NAME_LEN} bytes"))
    } else {
        value
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
            .map(|c| format!("has {c:?}; use ASCII letters, digits, `_`, `-` and `.`"))
    };
    match why {
        Some(why) => Err(syn::Error::new_spanned(
            name,
            format!("#[idem_sdk::plugin] argument `{key}`: the name {value:?} {why}"),
        )),
        None => Ok(()),
    }
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
    use super::{Args, check_signature};
    use syn::parse::Parser;

    fn declare(attr: &str) -> Result<String, String> {
        let mut args = Args::default();
        let parser = syn::meta::parser(|meta| args.parse(meta));
        let tokens: proc_macro2::TokenStream = attr.parse().expect("tokens");
        parser.parse2(tokens).map_err(|e| e.to_string())?;
        args.declaration().map_err(|e| e.to_string())
    }

    #[test]
    fn declarations_are_written_as_versioned_json() {
        assert_eq!(
            declare("").unwrap(),
            r#"{"v":1,"providers":[],"enqueues":[]}"#
        );
        assert_eq!(
            declare(r#"providers = ["email"]"#).unwrap(),
            r#"{"v":1,"providers":["email"],"enqueues":[]}"#
        );
        assert_eq!(
            declare(r#"providers = ["partner", "jobs"], enqueues = ["send_invoice_email"]"#)
                .unwrap(),
            r#"{"v":1,"providers":["partner","jobs"],"enqueues":["send_invoice_email"]}"#
        );
    }

    #[test]
    fn each_wrong_declaration_names_the_attribute_and_the_fix() {
        for (attr, says) in [
            (
                r#"provider = ["email"]"#,
                "unknown #[idem_sdk::plugin] argument `provider`",
            ),
            (r#"providers = "email""#, "takes a list of string literals"),
            ("providers = [email]", "takes string literals"),
            ("providers", "takes a list"),
            (r#"providers = [""]"#, "is empty"),
            (r#"providers = ["e mail"]"#, "' '"),
            (r#"providers = ["a", "a"]"#, "twice"),
            (r#"providers = ["a"], providers = ["b"]"#, "given twice"),
            (r#"providers = ["jobs"]"#, "needs `enqueues"),
            (
                r#"providers = ["jobs"], enqueues = []"#,
                "at least one plugin",
            ),
            (r#"enqueues = ["child"]"#, "needs \"jobs\" in `providers`"),
        ] {
            let error = declare(attr).expect_err(attr);
            assert!(error.contains("#[idem_sdk::plugin]"), "{attr}: {error}");
            assert!(error.contains(says), "{attr}: {error}");
        }
    }

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
