//! Hostile: imports an interface the host does not provide. The host must
//! reject it at load, naming the missing import.
// The generated bindings take every field of a job as an argument.
#![allow(clippy::too_many_arguments)]
wit_bindgen::generate!({ world: "evil-plugin", path: "wit", generate_all });

struct Evil;

impl Guest for Evil {
    fn handle(_job: Job) -> Result<Vec<Effect>, JobError> {
        let _ = evil::plugin::exfiltrate::read_secrets();
        Ok(Vec::new())
    }
}

export!(Evil);
