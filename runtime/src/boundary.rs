//! The one rule set for text that enters idem from outside: a plugin's
//! output, a provider's answer, a broker message, an API call. Every such
//! string is checked here, once, where it enters, so what reaches the store
//! and the logs is always storable (PostgreSQL refuses a NUL byte in text,
//! and one refused value used to fail every write of its batch) and always
//! safe to print.
//!
//! Each field is either **refused** (an identifier: a wrong one must not be
//! silently turned into another identifier) or **cleaned** (prose and
//! references: what matters survives, the rest is replaced):
//!
//! | field | rule | on a refusal |
//! |---|---|---|
//! | `error_code` | 1..=64 bytes of `a-z A-Z 0-9 _ . : -` | the plugin's error keeps its class, code `invalid_error_code` |
//! | `error_message` | cleaned: URLs redacted to `scheme://host:port/…` ([`redact_urls`]), control characters (but tab and newline) become U+FFFD, cut to [`MAX_MESSAGE`] bytes | — |
//! | `name` (queue, plugin) | 1..=128 bytes of `a-z A-Z 0-9 _ . : -` | an invalid effect, an invalid input (API: 400) |
//! | `correlation_id` | 1..=255 printable ASCII bytes (space included, as a key) | an invalid input (API: 400) |
//! | `result_ref` | cleaned: control characters dropped, cut to [`MAX_RESULT_REF`] bytes; empty is none | — |
//! | `idempotency_key` | the SDK's key rule: 1..=255 printable ASCII bytes | a dead job on arrival (broker), an invalid input |
//! | `group` | as `idempotency_key` (a group is an entity's id) | a dead job on arrival (broker), an invalid input |
//!
//! The same rules are kept as data in `tests/vectors/strings.json`, which
//! every path's tests read (and later SDKs can), so the paths cannot drift
//! apart.
//!
//! ```
//! use idem::boundary;
//! assert!(boundary::error_code("card_declined").is_ok());
//! assert!(boundary::error_code("nul\0code").is_err());
//! assert_eq!(boundary::message("a\0b"), "a\u{fffd}b");
//! ```

/// Longest message kept, in bytes (longer ones are cut at a char boundary
/// and marked `...`).
pub const MAX_MESSAGE: usize = 2048;

/// Longest provider result reference kept, in bytes.
pub const MAX_RESULT_REF: usize = 512;

/// Longest error code.
pub const MAX_ERROR_CODE: usize = 64;

/// Longest queue or plugin name.
pub const MAX_NAME: usize = 128;

/// Longest correlation id (a broker message's key is one).
pub const MAX_CORRELATION_ID: usize = 255;

/// Why a string was refused, for the caller's own classified error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} {shown} is refused: {why}")]
pub struct Refused {
    /// The field's name in the rule set.
    pub field: &'static str,
    /// The value, shown safely (see [`shown`]).
    pub shown: String,
    /// The rule it breaks.
    pub why: &'static str,
}

impl Refused {
    fn new(field: &'static str, value: &str, why: &'static str) -> Self {
        Refused {
            field,
            shown: shown(value),
            why,
        }
    }
}

/// A value for a log line or an error message: quoted, control and
/// non-ASCII characters escaped, cut to 80 characters.
///
/// `assert_eq!(idem::boundary::shown("a\0b"), "\"a\\0b\"");`
pub fn shown(value: &str) -> String {
    const MAX_SHOWN: usize = 80;
    let mut escaped: String = value.chars().take(MAX_SHOWN).collect::<String>();
    escaped = format!("{escaped:?}");
    if value.chars().nth(MAX_SHOWN).is_some() {
        escaped.push_str("...");
    }
    escaped
}

fn is_identifier_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-')
}

fn identifier(field: &'static str, value: &str, max: usize) -> Result<(), Refused> {
    if value.is_empty() {
        return Err(Refused::new(field, value, "it is empty"));
    }
    if value.len() > max {
        return Err(Refused::new(field, value, "it is too long"));
    }
    if !value.bytes().all(is_identifier_byte) {
        return Err(Refused::new(
            field,
            value,
            "only ASCII letters, digits and _ . : - are allowed",
        ));
    }
    Ok(())
}

/// An error code (a plugin's or a provider's): 1..=64 bytes of ASCII
/// letters, digits and `_ . : -`.
///
/// `assert!(idem::boundary::error_code("").is_err());`
pub fn error_code(code: &str) -> Result<(), Refused> {
    if code.len() > MAX_ERROR_CODE {
        return Err(Refused::new(
            "error_code",
            code,
            "it is longer than 64 bytes",
        ));
    }
    identifier("error_code", code, MAX_ERROR_CODE)
}

/// A queue or plugin name: 1..=128 bytes of ASCII letters, digits and
/// `_ . : -` (a plugin's name is the first part of every key it scopes, so
/// it never holds a `/`).
///
/// `assert!(idem::boundary::name("emails").is_ok());`
pub fn name(value: &str) -> Result<(), Refused> {
    identifier("name", value, MAX_NAME)
}

/// A correlation id: 1..=255 printable ASCII bytes, space included (a
/// broker message's key serves as one).
///
/// `assert!(idem::boundary::correlation_id("req-42").is_ok());`
pub fn correlation_id(value: &str) -> Result<(), Refused> {
    let field = "correlation_id";
    if value.is_empty() {
        return Err(Refused::new(field, value, "it is empty"));
    }
    if value.len() > MAX_CORRELATION_ID {
        return Err(Refused::new(field, value, "it is longer than 255 bytes"));
    }
    if !value.bytes().all(|b| (b' '..=b'~').contains(&b)) {
        return Err(Refused::new(
            field,
            value,
            "only printable ASCII is allowed",
        ));
    }
    Ok(())
}

/// What replaces a URL's path, query and fragment in [`redact_urls`].
pub const REDACTED_PATH: &str = "/\u{2026}";

/// What replaces a URL's user name and password in [`redact_urls`].
pub const REDACTED_USERINFO: &str = "\u{2026}@";

/// Where a URL starting at `text[0]` ends in prose: at whitespace, a
/// control character, a double quote, an angle bracket, a backtick, or the
/// backslash of an escaped quote (`\"` in JSON text). A single quote or a
/// lone backslash does not end it: both are valid in a URL's path (a
/// parser reads `\\` as `/`), and stopping there would show the rest.
fn url_end(text: &str) -> usize {
    let mut chars = text.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        let escaped_quote = c == '\\' && matches!(chars.peek(), Some((_, '"')) | Some((_, '\'')));
        if c.is_whitespace()
            || c.is_control()
            || matches!(c, '"' | '<' | '>' | '`')
            || escaped_quote
        {
            return i;
        }
    }
    text.len()
}

/// Where a URL's host (and port) ends after its userinfo.
const HOST_ENDS: &[char] = &['/', '?', '#', '\\', ';'];

/// Punctuation at the end of a URL that belongs to the sentence around it
/// (`for url (https://host/path)`, `see https://host/path.`), kept after
/// the redacted path.
const SENTENCE_PUNCTUATION: &[char] = &[')', ']', '}', '.', ',', ';', ':', '!', '?'];

fn is_scheme_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.')
}

/// Every URL in `text` (`scheme://...`, any scheme) with its user name,
/// password, path, query and fragment replaced, its scheme, host and port
/// kept: `https://user:pw@host:8443/hook/T0?api_key=S` becomes
/// `https://…@host:8443/…`. A URL without userinfo whose path is empty or
/// `/` is kept as it is. A URL ends at whitespace, a control character, a
/// double quote, `<`, `>`, a backtick or an escaped quote (`\"`, JSON
/// text); closing punctuation at its end (`)` `.` `,` ...) is kept after
/// the redacted path. Everything before the URL's **last** `@` is userinfo
/// (a password may hold `/`, `?` or `#`), and the host ends at `/`, `?`,
/// `#`, `\\` (a parser reads it as `/`) or `;`, so the host shown is never
/// part of a path or a password. Redacting twice changes nothing.
///
/// Provider URLs often carry a credential (a webhook's secret path, an
/// `?api_key=`, a database password), and error texts (reqwest's
/// `... for url (...)`) quote them: every message stored or logged passes
/// through [`message`], which calls this.
///
/// ```
/// use idem::boundary::redact_urls;
/// assert_eq!(
///     redact_urls("error sending request for url (https://hooks.example/T0/B1?api_key=S)"),
///     "error sending request for url (https://hooks.example/\u{2026})"
/// );
/// assert_eq!(redact_urls("postgres://app:pw@db:5432/billing"), "postgres://\u{2026}@db:5432/\u{2026}");
/// ```
pub fn redact_urls(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.contains("://") {
        return std::borrow::Cow::Borrowed(text);
    }
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    // `text[..copied]` is in `out`; the next `://` is searched from `search`.
    let mut copied = 0;
    let mut search = 0;
    while let Some(found) = text[search..].find("://") {
        let separator = search + found;
        let mut start = separator;
        while start > copied && is_scheme_byte(bytes[start - 1]) {
            start -= 1;
        }
        // A scheme starts with a letter (`1http://` is `http://`).
        while start < separator && !bytes[start].is_ascii_alphabetic() {
            start += 1;
        }
        let after = separator + 3;
        if start == separator {
            search = after;
            continue;
        }
        let end = after + url_end(&text[after..]);
        let url = &text[after..end];
        // The last `@` of the whole URL: a password may hold `/`, `?`, `#`
        // (unencoded), and a path holding `@` is then hidden too.
        let (userinfo, rest) = match url.rfind('@') {
            Some(at) => (true, &url[at + 1..]),
            None => (false, url),
        };
        let (host, tail) = rest.split_at(rest.find(HOST_ENDS).unwrap_or(rest.len()));
        let path = tail.trim_end_matches(SENTENCE_PUNCTUATION);
        let punctuation = &tail[path.len()..];
        out.push_str(&text[copied..after]);
        if userinfo {
            out.push_str(REDACTED_USERINFO);
        }
        out.push_str(host);
        if path.is_empty() || path == "/" {
            out.push_str(path);
        } else {
            out.push_str(REDACTED_PATH);
        }
        out.push_str(punctuation);
        copied = end;
        search = end;
    }
    out.push_str(&text[copied..]);
    std::borrow::Cow::Owned(out)
}

fn is_kept_control(c: char) -> bool {
    c == '\n' || c == '\t'
}

/// A message (an error's, a panic's, a provider's): URLs redacted (see
/// [`redact_urls`]), every control character but tab and newline becomes
/// U+FFFD, and the text is cut to [`MAX_MESSAGE`] bytes on a char
/// boundary, marked `...`.
///
/// `assert_eq!(idem::boundary::message("ok\n"), "ok\n");`
pub fn message(text: &str) -> String {
    let mut cleaned: String = redact_urls(text)
        .chars()
        .map(|c| {
            if c.is_control() && !is_kept_control(c) {
                '\u{fffd}'
            } else {
                c
            }
        })
        .collect();
    if cleaned.len() > MAX_MESSAGE {
        let mut end = MAX_MESSAGE - 3;
        while !cleaned.is_char_boundary(end) {
            end -= 1;
        }
        cleaned.truncate(end);
        cleaned.push_str("...");
    }
    cleaned
}

/// A line a plugin writes to the host's log (the `log` import, its stdout
/// and stderr): every control character, newlines included, written as its
/// escape (`\n`, `\u{0}`), so a plugin can neither forge a line of its own
/// nor move the terminal; cut to `max` bytes on a char boundary, marked
/// `...`.
///
/// `assert_eq!(idem::boundary::log_line("a\nforged", 100), "a\\nforged");`
pub fn log_line(text: &str, max: usize) -> String {
    let mut line = String::with_capacity(text.len().min(max));
    for c in text.chars() {
        if line.len() >= max {
            line.push_str("...");
            break;
        }
        if c.is_control() {
            line.extend(c.escape_default());
        } else {
            line.push(c);
        }
    }
    line
}

/// A provider's result reference: control characters dropped, cut to
/// [`MAX_RESULT_REF`] bytes on a char boundary; `None` when nothing is left
/// (the effect still succeeded: only its reference is lost).
///
/// `assert_eq!(idem::boundary::result_ref("msg_1\0"), Some("msg_1".into()));`
pub fn result_ref(value: &str) -> Option<String> {
    let mut cleaned: String = value.chars().filter(|c| !c.is_control()).collect();
    if cleaned.len() > MAX_RESULT_REF {
        let mut end = MAX_RESULT_REF;
        while !cleaned.is_char_boundary(end) {
            end -= 1;
        }
        cleaned.truncate(end);
    }
    let trimmed = cleaned.trim();
    (!trimmed.is_empty()).then(|| trimmed.to_string())
}

/// An idempotency key, by the SDK's rule (1..=255 printable ASCII bytes).
///
/// `assert!(idem::boundary::idempotency_key("order:1").is_ok());`
pub fn idempotency_key(key: &str) -> Result<(), Refused> {
    idem_sdk::key::validate(key).map_err(|e| Refused {
        field: "idempotency_key",
        shown: shown(key),
        why: match e {
            idem_sdk::key::InvalidKey::Empty => "it is empty",
            idem_sdk::key::InvalidKey::TooLong(_) => "it is longer than 255 bytes",
            idem_sdk::key::InvalidKey::NotPrintable(_) => "only printable ASCII is allowed",
        },
    })
}

/// A group (concurrency key), by the same rule as an idempotency key
/// (1..=255 printable ASCII bytes): it is an entity's id, like a key.
///
/// `assert!(idem::boundary::group_key("order:42").is_ok());`
pub fn group_key(group: &str) -> Result<(), Refused> {
    idempotency_key(group).map_err(|r| Refused {
        field: "group",
        ..r
    })
}

/// The shared test vectors (`tests/vectors/strings.json`), read by every
/// path's tests.
pub mod vectors {
    use serde::Deserialize;

    /// What a rule does with one input.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum Expected {
        /// Taken as it is.
        Accepted,
        /// Taken, changed into this (`None`: dropped).
        Cleaned(Option<String>),
        /// Refused.
        Refused,
    }

    /// One case of a field.
    #[derive(Debug, Clone)]
    pub struct Case {
        /// What the case shows.
        pub note: String,
        /// The input.
        pub input: String,
        /// What the rule does with it.
        pub expected: Expected,
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Text {
        Plain(String),
        Repeat {
            repeat: String,
            times: usize,
            #[serde(default)]
            tail: String,
        },
    }

    impl Text {
        fn expand(self) -> String {
            match self {
                Text::Plain(text) => text,
                Text::Repeat {
                    repeat,
                    times,
                    tail,
                } => repeat.repeat(times) + &tail,
            }
        }
    }

    #[derive(Deserialize)]
    struct RawCase {
        field: String,
        note: String,
        input: Text,
        outcome: String,
        #[serde(default)]
        output: Option<Text>,
    }

    #[derive(Deserialize)]
    struct File {
        cases: Vec<RawCase>,
    }

    /// Every case of `field` (panics on a malformed file: it is test data).
    pub fn of(field: &str) -> Vec<Case> {
        let file: File = serde_json::from_str(include_str!("../../tests/vectors/strings.json"))
            .expect("tests/vectors/strings.json is valid");
        let cases: Vec<Case> = file
            .cases
            .into_iter()
            .filter(|c| c.field == field)
            .map(|c| Case {
                note: c.note,
                input: c.input.expand(),
                expected: match c.outcome.as_str() {
                    "accepted" => Expected::Accepted,
                    "refused" => Expected::Refused,
                    "cleaned" => Expected::Cleaned(c.output.map(Text::expand)),
                    other => panic!("unknown outcome {other:?}"),
                },
            })
            .collect();
        assert!(!cases.is_empty(), "no vectors for {field}");
        cases
    }
}

#[cfg(test)]
mod tests {
    use super::vectors::{self, Expected};
    use super::*;

    fn check_refusals(field: &str, rule: impl Fn(&str) -> Result<(), Refused>) {
        for case in vectors::of(field) {
            let got = rule(&case.input);
            match case.expected {
                Expected::Accepted => assert!(got.is_ok(), "{field} {}: {got:?}", case.note),
                Expected::Refused => {
                    let refused = got.expect_err(&case.note);
                    assert!(
                        !refused.to_string().contains('\0'),
                        "a refusal prints safely"
                    );
                }
                Expected::Cleaned(_) => panic!("{field} is never cleaned"),
            }
        }
    }

    #[test]
    fn identifiers_follow_the_vectors() {
        check_refusals("error_code", error_code);
        check_refusals("name", name);
        check_refusals("correlation_id", correlation_id);
        check_refusals("idempotency_key", idempotency_key);
        // A group follows the key's rule, so the key's vectors hold for it.
        check_refusals("idempotency_key", group_key);
    }

    #[test]
    fn messages_follow_the_vectors() {
        for case in vectors::of("error_message") {
            let got = message(&case.input);
            match case.expected {
                Expected::Accepted => assert_eq!(got, case.input, "{}", case.note),
                Expected::Cleaned(Some(want)) => assert_eq!(got, want, "{}", case.note),
                other => panic!("a message is never {other:?}"),
            }
            assert!(got.len() <= MAX_MESSAGE);
        }
    }

    #[test]
    fn result_refs_follow_the_vectors() {
        for case in vectors::of("result_ref") {
            let got = result_ref(&case.input);
            match case.expected {
                Expected::Accepted => assert_eq!(got.as_deref(), Some(case.input.as_str())),
                Expected::Cleaned(want) => assert_eq!(got, want, "{}", case.note),
                Expected::Refused => panic!("a result reference is never refused"),
            }
        }
    }

    #[test]
    fn log_lines_escape_every_control_character() {
        let line = log_line("ok\nforged job_id=1\r\0\u{1b}[2J\u{7}\t\u{85}é", 1000);
        assert_eq!(
            line,
            "ok\\nforged job_id=1\\r\\u{0}\\u{1b}[2J\\u{7}\\t\\u{85}é"
        );
        assert!(!line.chars().any(char::is_control), "{line:?}");
        let long = log_line(&"é".repeat(100), 11);
        assert!(long.len() <= 11 + 4 && long.ends_with("..."), "{long:?}");
    }

    /// Issue 24, item 5: what each URL keeps (scheme, host, port) and
    /// what it loses (userinfo, path, query, fragment).
    #[test]
    fn urls_keep_their_origin_and_lose_the_rest() {
        for (text, want) in [
            // reqwest's own form, the URL in parentheses.
            (
                "error sending request for url (https://hooks.example/T0/B1/SECRET?api_key=SECRET)",
                "error sending request for url (https://hooks.example/\u{2026})",
            ),
            // Several URLs, closing punctuation kept.
            (
                "tried http://a.example/x?k=SECRET, then https://b.example:8443/y#SECRET.",
                "tried http://a.example/\u{2026}, then https://b.example:8443/\u{2026}.",
            ),
            // Userinfo with a password (an `@` in it too), any scheme.
            (
                "postgres://app:SECRET@db.internal:5432/billing?sslmode=require",
                "postgres://\u{2026}@db.internal:5432/\u{2026}",
            ),
            ("amqp://guest:SE@CRET@mq:5672", "amqp://\u{2026}@mq:5672"),
            ("https://user@host", "https://\u{2026}@host"),
            // IPv6 hosts keep their brackets and port.
            (
                "cannot connect to http://[::1]:8080/hook?token=SECRET",
                "cannot connect to http://[::1]:8080/\u{2026}",
            ),
            ("(http://[fe80::1])", "(http://[fe80::1])"),
            // A query straight after the host, and a fragment.
            ("https://h?api_key=SECRET", "https://h/\u{2026}"),
            ("https://h#SECRET", "https://h/\u{2026}"),
            // Nothing to hide: kept as it is.
            (
                "see https://status.example/ or https://h:1",
                "see https://status.example/ or https://h:1",
            ),
            // Quoted (a Debug print), and escaped quotes in JSON text.
            ("url: \"https://h/SECRET\"", "url: \"https://h/\u{2026}\""),
            (
                "{\"m\":\"for url (https://h/p?k=SECRET)\"}",
                "{\"m\":\"for url (https://h/\u{2026})\"}",
            ),
            // UTF-8 around and inside.
            (
                "échec: https://exemple.fr/d\u{e9}p\u{f4}t?cl\u{e9}=SECRET \u{2713}",
                "échec: https://exemple.fr/\u{2026} \u{2713}",
            ),
            (
                "https://b\u{fc}cher.example/SECRET",
                "https://b\u{fc}cher.example/\u{2026}",
            ),
            // Text without URLs, and `://` without a scheme.
            ("the card was declined", "the card was declined"),
            ("résumé ✓ a://", "résumé ✓ a://"),
            (" ://h/SECRET", " ://h/SECRET"),
            ("", ""),
            // A scheme glued to earlier text starts at its first letter.
            ("x1+http://h/SECRET", "x1+http://h/\u{2026}"),
            // A password holding `#`, `?` or `/` unencoded, and a path
            // holding `@`: all before the last `@` is hidden.
            (
                "postgres://app:pa#SECRET@db:5432/billing",
                "postgres://\u{2026}@db:5432/\u{2026}",
            ),
            ("amqp://u:a/b?SECRET@mq/v", "amqp://\u{2026}@mq/\u{2026}"),
            ("https://h/T0/SECRET@x", "https://\u{2026}@x"),
            // A backslash (a parser reads `/`), a `;` and a single quote do
            // not end the URL or its host.
            (
                "https://hooks.example\\T0\\SECRET",
                "https://hooks.example/\u{2026}",
            ),
            (
                "https://hooks.example;SECRET",
                "https://hooks.example/\u{2026}",
            ),
            (
                "https://hooks.example/T0'SECRET",
                "https://hooks.example/\u{2026}",
            ),
            // Tabs and newlines end a URL (a message keeps them).
            (
                "https://h/SECRET\nnext line",
                "https://h/\u{2026}\nnext line",
            ),
        ] {
            let got = redact_urls(text);
            assert_eq!(got, want, "{text:?}");
            assert!(!got.contains("SECRET") || text == " ://h/SECRET", "{got:?}");
            assert_eq!(
                redact_urls(&got),
                got,
                "redacting twice changes nothing: {got:?}"
            );
        }
    }

    #[test]
    fn messages_redact_urls_before_they_are_cut() {
        let long = format!("{} https://h/{}", "x".repeat(100), "SECRET".repeat(1000));
        let got = message(&long);
        assert!(!got.contains("SECRET"), "{got}");
        assert!(got.ends_with("https://h/\u{2026}"), "{got}");
        assert_eq!(
            message("for url (http://h/p?k=SECRET)\0"),
            "for url (http://h/\u{2026})\u{fffd}"
        );
    }

    #[test]
    fn shown_values_are_escaped_and_bounded() {
        assert_eq!(shown("ok"), "\"ok\"");
        assert_eq!(shown("a\u{1b}[31m"), "\"a\\u{1b}[31m\"");
        let long = shown(&"x".repeat(1000));
        assert!(long.len() < 100 && long.ends_with("..."), "{long}");
    }
}
