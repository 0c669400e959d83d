//! What a plugin declares it needs, stored inside its component.
//!
//! `#[plugin(providers = ["partner", "jobs"], enqueues = ["send_invoice_email"])]`
//! embeds a custom section named [`SECTION`] in the plugin's core module,
//! holding small versioned JSON:
//!
//! ```json
//! {"v":1,"providers":["partner","jobs"],"enqueues":["send_invoice_email"]}
//! ```
//!
//! The host reads it without instantiating the component; an operator file
//! beside the `.wasm` may only narrow it. The rules below are shared by the
//! macro (compile errors) and the host (load errors).
//!
//! ```
//! use idem_sdk::declaration::Declaration;
//! let d = Declaration::parse(br#"{"v":1,"providers":["email"],"enqueues":[]}"#).unwrap();
//! assert_eq!(d.providers, ["email"]);
//! ```

use serde::Deserialize;
use std::fmt;

/// The built-in provider that enqueues child jobs.
pub const JOBS_PROVIDER: &str = "jobs";

/// Name of the wasm custom section holding the declaration.
pub const SECTION: &str = "idem-plugin-manifest";
/// The format version this SDK writes and reads.
pub const VERSION: u32 = 1;
/// Most names in one list (`providers` or `enqueues`).
pub const MAX_NAMES: usize = 64;
/// Longest provider or plugin name, in bytes.
pub const MAX_NAME_LEN: usize = 64;
/// Largest section accepted, in bytes.
pub const MAX_SECTION_LEN: usize = 16 * 1024;

/// The providers a plugin may use and the plugins it may enqueue.
///
/// ```
/// use idem_sdk::declaration::Declaration;
/// let d = Declaration { providers: vec!["jobs".into()], enqueues: vec!["child".into()] };
/// assert_eq!(Declaration::parse(d.to_json().as_bytes()).unwrap(), d);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Declaration {
    /// Providers the plugin's effects use (`"jobs"` for child jobs).
    pub providers: Vec<String>,
    /// Plugins the plugin may enqueue through the `jobs` provider.
    pub enqueues: Vec<String>,
}

/// Why a declaration cannot be used.
///
/// ```
/// use idem_sdk::declaration::{Declaration, InvalidDeclaration};
/// let err = Declaration::parse(br#"{"v":2,"providers":[],"enqueues":[]}"#).unwrap_err();
/// assert_eq!(err, InvalidDeclaration::Version(2));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InvalidDeclaration {
    /// Larger than [`MAX_SECTION_LEN`] (the size is given).
    TooLarge(usize),
    /// Not the JSON shape of version [`VERSION`].
    Shape(String),
    /// A version this SDK does not know.
    Version(u64),
    /// A list with more than [`MAX_NAMES`] names.
    TooMany(&'static str),
    /// A name that breaks the rules of [`validate_name`].
    Name(&'static str, String, InvalidName),
    /// A name listed twice.
    Duplicate(&'static str, String),
    /// `providers` has `"jobs"` but `enqueues` is empty.
    JobsWithoutEnqueues,
    /// `enqueues` names plugins but `providers` lacks `"jobs"`.
    EnqueuesWithoutJobs,
}

impl fmt::Display for InvalidDeclaration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InvalidDeclaration::TooLarge(len) => write!(
                f,
                "the {SECTION} section is {len} bytes, at most {MAX_SECTION_LEN} allowed"
            ),
            InvalidDeclaration::Shape(why) => write!(
                f,
                "the {SECTION} section is not {{\"v\":{VERSION},\"providers\":[..],\"enqueues\":[..]}}: {why}"
            ),
            InvalidDeclaration::Version(v) => write!(
                f,
                "the {SECTION} section has version {v}; this host reads version {VERSION}"
            ),
            InvalidDeclaration::TooMany(list) => {
                write!(f, "`{list}` lists more than {MAX_NAMES} names")
            }
            InvalidDeclaration::Name(list, name, why) => {
                write!(f, "`{list}` has an invalid name {name:?}: {why}")
            }
            InvalidDeclaration::Duplicate(list, name) => {
                write!(f, "`{list}` lists {name:?} twice")
            }
            InvalidDeclaration::JobsWithoutEnqueues => write!(
                f,
                "`providers` has \"{JOBS_PROVIDER}\" but `enqueues` names no plugin to enqueue"
            ),
            InvalidDeclaration::EnqueuesWithoutJobs => write!(
                f,
                "`enqueues` names plugins but `providers` lacks \"{JOBS_PROVIDER}\", the provider that enqueues them"
            ),
        }
    }
}

impl std::error::Error for InvalidDeclaration {}

/// Why a provider or plugin name is refused.
///
/// ```
/// use idem_sdk::declaration::{validate_name, InvalidName};
/// assert_eq!(validate_name("a/b"), Err(InvalidName::Character('/')));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InvalidName {
    /// The name is empty.
    Empty,
    /// Longer than [`MAX_NAME_LEN`] bytes.
    TooLong,
    /// A character other than ASCII letters, digits, `_`, `-` and `.`.
    Character(char),
}

impl fmt::Display for InvalidName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InvalidName::Empty => write!(f, "the name is empty"),
            InvalidName::TooLong => write!(f, "the name is longer than {MAX_NAME_LEN} bytes"),
            InvalidName::Character(c) => write!(
                f,
                "{c:?} is not allowed (ASCII letters, digits, `_`, `-` and `.` are)"
            ),
        }
    }
}

impl std::error::Error for InvalidName {}

/// Checks a provider or plugin name: non-empty, at most [`MAX_NAME_LEN`]
/// bytes, ASCII letters, digits, `_`, `-` and `.`.
///
/// ```
/// use idem_sdk::declaration::validate_name;
/// assert!(validate_name("send_invoice_email").is_ok());
/// assert!(validate_name("").is_err() && validate_name("a b").is_err());
/// ```
pub fn validate_name(name: &str) -> Result<(), InvalidName> {
    if name.is_empty() {
        return Err(InvalidName::Empty);
    }
    if name.len() > MAX_NAME_LEN {
        return Err(InvalidName::TooLong);
    }
    match name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
    {
        Some(c) => Err(InvalidName::Character(c)),
        None => Ok(()),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Wire {
    v: u64,
    providers: Vec<String>,
    enqueues: Vec<String>,
}

#[derive(Deserialize)]
struct VersionOnly {
    v: u64,
}

impl Declaration {
    /// Reads and validates the bytes of a [`SECTION`] section.
    ///
    /// ```
    /// use idem_sdk::declaration::Declaration;
    /// assert!(Declaration::parse(br#"{"v":1,"providers":[""],"enqueues":[]}"#).is_err());
    /// ```
    pub fn parse(bytes: &[u8]) -> Result<Self, InvalidDeclaration> {
        if bytes.len() > MAX_SECTION_LEN {
            return Err(InvalidDeclaration::TooLarge(bytes.len()));
        }
        // The version decides the shape, so read it before the rest.
        if let Ok(VersionOnly { v }) = serde_json::from_slice::<VersionOnly>(bytes)
            && v != u64::from(VERSION)
        {
            return Err(InvalidDeclaration::Version(v));
        }
        let wire: Wire =
            serde_json::from_slice(bytes).map_err(|e| InvalidDeclaration::Shape(e.to_string()))?;
        debug_assert_eq!(wire.v, u64::from(VERSION));
        let declaration = Declaration {
            providers: wire.providers,
            enqueues: wire.enqueues,
        };
        declaration.validate()?;
        Ok(declaration)
    }

    /// Checks names, sizes and that `jobs` and `enqueues` come together.
    ///
    /// ```
    /// use idem_sdk::declaration::Declaration;
    /// let d = Declaration { providers: vec!["jobs".into()], enqueues: vec![] };
    /// assert!(d.validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), InvalidDeclaration> {
        for (list, names) in [("providers", &self.providers), ("enqueues", &self.enqueues)] {
            if names.len() > MAX_NAMES {
                return Err(InvalidDeclaration::TooMany(list));
            }
            for (i, name) in names.iter().enumerate() {
                validate_name(name)
                    .map_err(|why| InvalidDeclaration::Name(list, name.clone(), why))?;
                if names[..i].contains(name) {
                    return Err(InvalidDeclaration::Duplicate(list, name.clone()));
                }
            }
        }
        let jobs = self.providers.iter().any(|p| p == JOBS_PROVIDER);
        match (jobs, self.enqueues.is_empty()) {
            (true, true) => Err(InvalidDeclaration::JobsWithoutEnqueues),
            (false, false) => Err(InvalidDeclaration::EnqueuesWithoutJobs),
            _ => Ok(()),
        }
    }

    /// The section's JSON, as `#[plugin]` writes it.
    ///
    /// ```
    /// use idem_sdk::declaration::Declaration;
    /// assert_eq!(Declaration::default().to_json(), r#"{"v":1,"providers":[],"enqueues":[]}"#);
    /// ```
    pub fn to_json(&self) -> String {
        // Field order as the macro writes it, so both produce the same bytes.
        let list = |names: &[String]| serde_json::to_string(names).unwrap_or_default();
        format!(
            r#"{{"v":{VERSION},"providers":{},"enqueues":{}}}"#,
            list(&self.providers),
            list(&self.enqueues)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Declaration, InvalidDeclaration> {
        Declaration::parse(text.as_bytes())
    }

    #[test]
    fn the_written_form_reads_back() {
        let d =
            parse(r#"{"v":1,"providers":["partner","jobs"],"enqueues":["send_invoice_email"]}"#)
                .unwrap();
        assert_eq!(d.providers, ["partner", "jobs"]);
        assert_eq!(d.enqueues, ["send_invoice_email"]);
        assert_eq!(parse(&d.to_json()).unwrap(), d);
    }

    #[test]
    fn every_wrong_shape_is_refused_with_its_reason() {
        for (text, says) in [
            ("", "not {"),
            ("not json", "not {"),
            (r#"{"v":2,"providers":[],"enqueues":[]}"#, "version 2"),
            (r#"{"v":1,"providers":[]}"#, "enqueues"),
            (r#"{"v":1,"providers":"email","enqueues":[]}"#, "not {"),
            (
                r#"{"v":1,"providers":[],"enqueues":[],"x":1}"#,
                "unknown field",
            ),
            (r#"{"v":1,"providers":[""],"enqueues":[]}"#, "empty"),
            (r#"{"v":1,"providers":["a b"],"enqueues":[]}"#, "' '"),
            (r#"{"v":1,"providers":["e","e"],"enqueues":[]}"#, "twice"),
            (
                r#"{"v":1,"providers":["jobs"],"enqueues":[]}"#,
                "names no plugin",
            ),
            (
                r#"{"v":1,"providers":[],"enqueues":["c"]}"#,
                "lacks \"jobs\"",
            ),
        ] {
            let error = parse(text).expect_err(text).to_string();
            assert!(error.contains(says), "{text}: {error}");
        }
    }

    #[test]
    fn sizes_are_bounded() {
        let long = "x".repeat(MAX_NAME_LEN + 1);
        assert_eq!(validate_name(&long), Err(InvalidName::TooLong));
        let many: Vec<String> = (0..=MAX_NAMES).map(|i| format!("p{i}")).collect();
        let d = Declaration {
            providers: many,
            enqueues: vec![],
        };
        assert_eq!(d.validate(), Err(InvalidDeclaration::TooMany("providers")));
        let huge = vec![b' '; MAX_SECTION_LEN + 1];
        assert_eq!(
            Declaration::parse(&huge),
            Err(InvalidDeclaration::TooLarge(MAX_SECTION_LEN + 1))
        );
    }
}
