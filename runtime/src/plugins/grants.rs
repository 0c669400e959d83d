//! What a plugin may do: declared in its code, narrowed by the operator.
//!
//! A plugin built with `#[plugin(providers = [..], enqueues = [..])]` carries
//! its declaration in a custom section of its component
//! ([`idem_sdk::declaration::SECTION`]). The operator file `<name>.toml` may
//! list `providers` and `enqueues` too, but only to narrow: naming something
//! the plugin does not declare is a load error. The result, the *effective
//! grants*, decides every effect: a provider or child plugin outside it is a
//! permanent `effect_not_allowed` before anything is stored or executed.
//!
//! A component without the section (built without the SDK's macro, or in
//! another language against the WIT) declares nothing the host can read; its
//! grants come from the operator file alone, as they did before declarations.
//!
//! ```
//! use idem::plugins::{Grants, Manifest};
//! use idem_sdk::declaration::Declaration;
//! let declared = Declaration { providers: vec!["email".into()], enqueues: vec![] };
//! let grants = Grants::resolve("mailer", Some(declared), &Manifest::default()).unwrap();
//! assert!(grants.allows_provider("email") && !grants.allows_provider("partner"));
//! ```

use super::manifest::Manifest;
use crate::effects::{Action, Effect};
use crate::failure::{Code, Failure};
use crate::providers::JOBS_PROVIDER;
use idem_sdk::declaration::{Declaration, InvalidDeclaration, SECTION};
use std::fmt;

/// Why a plugin's grants cannot be worked out; the plugin does not load.
///
/// ```
/// use idem::plugins::{Grants, GrantsError, Manifest};
/// let wider = Manifest::parse("providers = [\"email\"]").unwrap();
/// let err = Grants::resolve("p", Some(Default::default()), &wider).unwrap_err();
/// assert!(matches!(err, GrantsError::Widened { .. }));
/// ```
#[derive(Debug, thiserror::Error)]
pub enum GrantsError {
    /// The component's declaration section is malformed.
    #[error("invalid {SECTION} section: {0}")]
    Declaration(#[from] InvalidDeclaration),
    /// The section appears more than once.
    #[error("the {SECTION} section appears {0} times; a plugin declares its needs once")]
    Repeated(usize),
    /// The component cannot be walked.
    #[error("cannot read the component's sections: {0}")]
    Parse(String),
    /// The operator file grants more than the plugin declares.
    #[error(
        "{plugin}.toml grants {what} {name:?}, which the plugin does not declare \
         (it declares {list} = [{declared}]); the operator file can only narrow what the plugin declares: \
         remove it there, or add it to #[plugin({list} = [..])] and rebuild"
    )]
    Widened {
        /// The plugin.
        plugin: String,
        /// `provider` or `child plugin`.
        what: &'static str,
        /// `providers` or `enqueues`.
        list: &'static str,
        /// The name granted but not declared.
        name: String,
        /// What the plugin declares in that list.
        declared: String,
    },
}

/// Reads the declaration a component carries, without instantiating it.
///
/// Walks the component and every nested module's custom sections. `None`
/// when no section has the name; an error when the section is malformed,
/// too large or present more than once.
///
/// ```
/// // A core module header only: no section, nothing declared.
/// assert_eq!(idem::plugins::grants::read_declaration(b"\0asm\x01\0\0\0").unwrap(), None);
/// ```
pub fn read_declaration(wasm: &[u8]) -> Result<Option<Declaration>, GrantsError> {
    let mut found: Vec<&[u8]> = Vec::new();
    for payload in wasmparser::Parser::new(0).parse_all(wasm) {
        let payload = payload.map_err(|e| GrantsError::Parse(e.to_string()))?;
        if let wasmparser::Payload::CustomSection(section) = payload
            && section.name() == SECTION
        {
            found.push(section.data());
        }
    }
    match found.as_slice() {
        [] => Ok(None),
        [data] => Ok(Some(Declaration::parse(data)?)),
        more => Err(GrantsError::Repeated(more.len())),
    }
}

/// Where a name is missing, so the message can say what to add where.
///
/// ```
/// use idem::plugins::grants::Missing;
/// assert_ne!(Missing::Undeclared, Missing::Narrowed);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Missing {
    /// The plugin does not declare it: declare it in the code and rebuild.
    Undeclared,
    /// Declared, but the operator file leaves it out.
    Narrowed,
    /// The component declares nothing and the operator file does not grant it.
    NotInOperatorFile,
}

/// An effect outside a plugin's effective grants.
///
/// ```
/// use idem::effects::{Action, Effect};
/// use idem::plugins::{Grants, Manifest, NotGranted};
/// let grants = Grants::resolve("p", Some(Default::default()), &Manifest::default()).unwrap();
/// let e = Effect { provider: "email".into(), idempotency_key: "k".into(), action: Action::Custom { body: vec![] } };
/// let refusal: NotGranted = grants.check(&e).unwrap_err();
/// assert!(refusal.fix().contains("#[plugin(providers = [..])]"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotGranted {
    /// The effect's provider is not granted.
    Provider {
        /// The plugin.
        plugin: String,
        /// The effect's idempotency key.
        key: String,
        /// The provider.
        provider: String,
        /// Where it is missing.
        missing: Missing,
    },
    /// A child job for a plugin the plugin may not enqueue.
    ChildPlugin {
        /// The plugin.
        plugin: String,
        /// The effect's idempotency key.
        key: String,
        /// The child job's plugin.
        child: String,
        /// Where it is missing.
        missing: Missing,
    },
}

impl NotGranted {
    /// What to add, and where, for the effect to be allowed (see the
    /// example on [`NotGranted`]).
    pub fn fix(&self) -> String {
        let (plugin, list, name, missing) = match self {
            NotGranted::Provider {
                plugin,
                provider,
                missing,
                ..
            } => (plugin, "providers", provider, *missing),
            NotGranted::ChildPlugin {
                plugin,
                child,
                missing,
                ..
            } => (plugin, "enqueues", child, *missing),
        };
        match missing {
            Missing::Undeclared => format!(
                "add {name:?} to #[plugin({list} = [..])] in the plugin's code and rebuild it"
            ),
            Missing::Narrowed => format!(
                "the plugin declares {name:?} but {plugin}.toml leaves it out: add it to `{list}` there"
            ),
            Missing::NotInOperatorFile => format!(
                "the component declares nothing (no {SECTION} section): add {name:?} to `{list}` in {plugin}.toml, or rebuild it with #[plugin({list} = [..])]"
            ),
        }
    }
}

impl fmt::Display for NotGranted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotGranted::Provider {
                plugin,
                key,
                provider,
                ..
            } => write!(
                f,
                "effect {key:?} uses provider {provider:?}, which {plugin} is not granted: {}",
                self.fix()
            ),
            NotGranted::ChildPlugin {
                plugin, key, child, ..
            } => write!(
                f,
                "effect {key:?} enqueues a {child:?} job, which {plugin} is not granted: {}",
                self.fix()
            ),
        }
    }
}

impl From<NotGranted> for Failure {
    fn from(refusal: NotGranted) -> Self {
        Failure::host(Code::EffectNotAllowed, refusal.to_string())
    }
}

/// A plugin's effective grants: its declaration narrowed by its operator file.
///
/// ```
/// use idem::plugins::{Grants, Manifest};
/// use idem_sdk::declaration::Declaration;
/// let declared = Declaration { providers: vec!["partner".into(), "jobs".into()], enqueues: vec!["invoice".into()] };
/// let grants = Grants::resolve("order_sync", Some(declared), &Manifest::parse("enqueues = []").unwrap()).unwrap();
/// assert!(grants.allows_provider("jobs") && !grants.allows_child("invoice"));
/// assert!(grants.is_narrowed());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grants {
    plugin: String,
    declared: Option<Declaration>,
    providers: Vec<String>,
    enqueues: Vec<String>,
}

impl Grants {
    /// Works out the effective grants of `plugin` from what its component
    /// declares and what its operator file lists.
    ///
    /// ```
    /// use idem::plugins::{Grants, Manifest};
    /// use idem_sdk::declaration::Declaration;
    /// let declared = Declaration { providers: vec!["email".into()], enqueues: vec![] };
    /// let wider = Manifest::parse("providers = [\"email\", \"partner\"]").unwrap();
    /// assert!(Grants::resolve("mailer", Some(declared), &wider).is_err());
    /// ```
    pub fn resolve(
        plugin: &str,
        declared: Option<Declaration>,
        manifest: &Manifest,
    ) -> Result<Self, GrantsError> {
        let (providers, enqueues) = match &declared {
            Some(declared) => (
                narrow(
                    plugin,
                    "provider",
                    "providers",
                    &declared.providers,
                    manifest.providers.as_deref(),
                )?,
                narrow(
                    plugin,
                    "child plugin",
                    "enqueues",
                    &declared.enqueues,
                    manifest.enqueues.as_deref(),
                )?,
            ),
            None => (
                dedup(manifest.providers.iter().flatten()),
                dedup(manifest.enqueues.iter().flatten()),
            ),
        };
        Ok(Grants {
            plugin: plugin.to_string(),
            declared,
            providers,
            enqueues,
        })
    }

    /// What the component declares (`None`: it has no declaration section).
    pub fn declared(&self) -> Option<&Declaration> {
        self.declared.as_ref()
    }

    /// Effective providers, in declared order.
    pub fn providers(&self) -> impl Iterator<Item = &str> {
        self.providers.iter().map(String::as_str)
    }

    /// Effective child plugins, in declared order.
    pub fn enqueues(&self) -> impl Iterator<Item = &str> {
        self.enqueues.iter().map(String::as_str)
    }

    /// Whether effects may use `provider`.
    pub fn allows_provider(&self, provider: &str) -> bool {
        self.providers.iter().any(|p| p == provider)
    }

    /// Whether child jobs for `plugin` may be enqueued (needs `jobs` too).
    pub fn allows_child(&self, plugin: &str) -> bool {
        self.allows_provider(JOBS_PROVIDER) && self.enqueues.iter().any(|p| p == plugin)
    }

    /// Whether the operator file took away something the plugin declares.
    pub fn is_narrowed(&self) -> bool {
        self.declared.as_ref().is_some_and(|d| {
            d.providers.len() != self.providers.len() || d.enqueues.len() != self.enqueues.len()
        })
    }

    /// Checks one effect: its provider and, for a child job, its plugin.
    ///
    /// ```
    /// use idem::effects::{Action, Effect};
    /// use idem::plugins::{Grants, Manifest};
    /// let grants = Grants::resolve("p", None, &Manifest::default()).unwrap();
    /// let e = Effect { provider: "report".into(), idempotency_key: "k".into(), action: Action::Custom { body: vec![] } };
    /// assert_eq!(idem::failure::Failure::from(grants.check(&e).unwrap_err()).code, "effect_not_allowed");
    /// ```
    pub fn check(&self, effect: &Effect) -> Result<(), NotGranted> {
        if !self.allows_provider(&effect.provider) {
            return Err(NotGranted::Provider {
                plugin: self.plugin.clone(),
                key: effect.idempotency_key.clone(),
                provider: effect.provider.clone(),
                missing: self.missing(&effect.provider, |d| &d.providers),
            });
        }
        if effect.provider == JOBS_PROVIDER
            && let Action::Enqueue { plugin: child, .. } = &effect.action
            && !self.enqueues.contains(child)
        {
            return Err(NotGranted::ChildPlugin {
                plugin: self.plugin.clone(),
                key: effect.idempotency_key.clone(),
                child: child.clone(),
                missing: self.missing(child, |d| &d.enqueues),
            });
        }
        Ok(())
    }

    /// Every effect of `plan` outside the grants, in plan order
    /// (`idem invoke` reports them all; the worker stops at the first).
    pub fn refusals(&self, plan: &[Effect]) -> Vec<NotGranted> {
        plan.iter().filter_map(|e| self.check(e).err()).collect()
    }

    fn missing(&self, name: &str, list: impl Fn(&Declaration) -> &Vec<String>) -> Missing {
        match &self.declared {
            None => Missing::NotInOperatorFile,
            Some(declared) if list(declared).iter().any(|n| n == name) => Missing::Narrowed,
            Some(_) => Missing::Undeclared,
        }
    }
}

fn dedup<'a>(names: impl Iterator<Item = &'a String>) -> Vec<String> {
    let mut unique: Vec<String> = Vec::new();
    for name in names {
        if !unique.contains(name) {
            unique.push(name.clone());
        }
    }
    unique
}

/// The declared names the operator file keeps; a name it adds is an error.
fn narrow(
    plugin: &str,
    what: &'static str,
    list: &'static str,
    declared: &[String],
    operator: Option<&[String]>,
) -> Result<Vec<String>, GrantsError> {
    let Some(operator) = operator else {
        return Ok(declared.to_vec());
    };
    if let Some(extra) = operator.iter().find(|n| !declared.contains(n)) {
        return Err(GrantsError::Widened {
            plugin: plugin.to_string(),
            what,
            list,
            name: extra.clone(),
            declared: declared
                .iter()
                .map(|n| format!("{n:?}"))
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    Ok(declared
        .iter()
        .filter(|n| operator.contains(n))
        .cloned()
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_sdk::declaration::MAX_SECTION_LEN;

    fn declared(providers: &[&str], enqueues: &[&str]) -> Option<Declaration> {
        Some(Declaration {
            providers: providers.iter().map(|s| s.to_string()).collect(),
            enqueues: enqueues.iter().map(|s| s.to_string()).collect(),
        })
    }

    fn manifest(text: &str) -> Manifest {
        Manifest::parse(text).unwrap()
    }

    fn email(key: &str) -> Effect {
        Effect {
            provider: "email".into(),
            idempotency_key: key.into(),
            action: Action::Email {
                to: vec!["a@b.c".into()],
                subject: String::new(),
                text: None,
                html: None,
                template: None,
            },
        }
    }

    fn child(plugin: &str) -> Effect {
        Effect {
            provider: JOBS_PROVIDER.into(),
            idempotency_key: format!("child:{plugin}"),
            action: Action::Enqueue {
                plugin: plugin.into(),
                queue: None,
                payload: b"{}".to_vec(),
                delay_ms: 0,
                priority: 0,
            },
        }
    }

    #[test]
    fn without_an_operator_file_the_declaration_is_granted() {
        let grants = Grants::resolve(
            "order_sync",
            declared(&["partner", "jobs"], &["invoice"]),
            &Manifest::default(),
        )
        .unwrap();
        assert!(grants.allows_provider("partner") && grants.allows_child("invoice"));
        assert!(grants.check(&child("invoice")).is_ok());
        assert!(!grants.is_narrowed());
    }

    #[test]
    fn the_operator_file_narrows_and_the_refusal_says_where_to_add() {
        let grants = Grants::resolve(
            "mailer",
            declared(&["email"], &[]),
            &manifest("providers = []"),
        )
        .unwrap();
        assert!(grants.is_narrowed());
        let refusal = grants.check(&email("k:1")).unwrap_err();
        assert!(matches!(
            refusal,
            NotGranted::Provider {
                missing: Missing::Narrowed,
                ..
            }
        ));
        assert!(
            refusal.to_string().contains("mailer.toml leaves it out"),
            "{refusal}"
        );
        assert_eq!(Failure::from(refusal).code, Code::EffectNotAllowed.as_str());
    }

    #[test]
    fn an_undeclared_provider_or_child_is_refused_naming_the_attribute() {
        let grants = Grants::resolve(
            "order_sync",
            declared(&["jobs"], &["invoice"]),
            &Manifest::default(),
        )
        .unwrap();
        let provider = grants.check(&email("k:1")).unwrap_err().to_string();
        assert!(
            provider.contains("#[plugin(providers = [..])]"),
            "{provider}"
        );
        let other = grants.check(&child("refund")).unwrap_err();
        assert!(matches!(other, NotGranted::ChildPlugin { .. }));
        assert!(
            other.to_string().contains("#[plugin(enqueues = [..])]"),
            "{other}"
        );
        let narrowed = Grants::resolve(
            "order_sync",
            declared(&["jobs"], &["invoice"]),
            &manifest("enqueues = []"),
        )
        .unwrap();
        assert!(!narrowed.allows_child("invoice"));
        assert_eq!(
            narrowed
                .refusals(&[child("invoice"), child("invoice")])
                .len(),
            2
        );
    }

    #[test]
    fn an_operator_file_cannot_widen_the_declaration() {
        for (text, names) in [
            (
                "providers = [\"email\", \"partner\"]",
                "provider \"partner\"",
            ),
            ("enqueues = [\"refund\"]", "child plugin \"refund\""),
        ] {
            let error = Grants::resolve("mailer", declared(&["email"], &[]), &manifest(text))
                .unwrap_err()
                .to_string();
            assert!(error.contains(names), "{error}");
            assert!(error.contains("can only narrow"), "{error}");
        }
    }

    #[test]
    fn an_undeclared_component_takes_its_grants_from_the_operator_file() {
        let grants = Grants::resolve(
            "legacy",
            None,
            &manifest("providers = [\"report\", \"jobs\"]\nenqueues = [\"x\"]"),
        )
        .unwrap();
        assert!(grants.allows_provider("report") && grants.allows_child("x"));
        assert!(!grants.allows_child("y"));
        let bare = Grants::resolve("legacy", None, &Manifest::default()).unwrap();
        let refusal = bare.check(&email("k")).unwrap_err();
        assert!(
            refusal
                .to_string()
                .contains("add \"email\" to `providers` in legacy.toml"),
            "{refusal}"
        );
    }

    #[test]
    fn malformed_or_repeated_sections_are_refused() {
        fn module_with(sections: &[&[u8]]) -> Vec<u8> {
            let mut wasm = b"\0asm\x01\0\0\0".to_vec();
            for data in sections {
                let mut body = vec![SECTION.len() as u8];
                body.extend_from_slice(SECTION.as_bytes());
                body.extend_from_slice(data);
                wasm.push(0);
                let mut len = body.len();
                loop {
                    let byte = (len & 0x7f) as u8;
                    len >>= 7;
                    wasm.push(if len == 0 { byte } else { byte | 0x80 });
                    if len == 0 {
                        break;
                    }
                }
                wasm.extend_from_slice(&body);
            }
            wasm
        }
        let good = br#"{"v":1,"providers":["email"],"enqueues":[]}"#;
        assert_eq!(
            read_declaration(&module_with(&[good])).unwrap(),
            declared(&["email"], &[])
        );
        let error = read_declaration(&module_with(&[b"{\"v\":1"])).unwrap_err();
        assert!(matches!(
            error,
            GrantsError::Declaration(InvalidDeclaration::Shape(_))
        ));
        let huge = vec![b' '; MAX_SECTION_LEN + 1];
        let error = read_declaration(&module_with(&[&huge])).unwrap_err();
        assert!(error.to_string().contains("at most"), "{error}");
        let error = read_declaration(&module_with(&[good, good])).unwrap_err();
        assert!(matches!(error, GrantsError::Repeated(2)));
    }
}
