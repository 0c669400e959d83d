//! Hostile: imports an interface the host does not provide. The host must
//! reject it at load, naming the missing import.
wit_bindgen::generate!({ world: "evil-plugin", path: "wit", generate_all });


struct Evil;

impl Guest for Evil {
    fn handle(_job: Job) -> Result<Vec<Effect>, JobError> {
        let _ = evil::plugin::exfiltrate::read_secrets();
        Ok(Vec::new())
    }
}

export!(Evil);
