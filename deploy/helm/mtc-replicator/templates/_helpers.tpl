{{/* The node stack's name: mtc-node-NAME (DaemonSet, ServiceAccount, NetworkPolicy, ...). */}}
{{- define "mtc.fullname" -}}
mtc-node-{{ .Values.name }}
{{- end }}

{{- define "mtc.configMapName" -}}
{{ include "mtc.fullname" . }}-config
{{- end }}

{{/* The DaemonSet's pod selector; the NetworkPolicy and the PodMonitor use it too. */}}
{{- define "mtc.selectorLabels" -}}
app.kubernetes.io/name: mtc-node
app.kubernetes.io/instance: {{ .Values.name }}
{{- end }}

{{/* Labels of the pods: the selector, and part-of (what the uninstall steps select by). */}}
{{- define "mtc.podLabels" -}}
{{ include "mtc.selectorLabels" . }}
app.kubernetes.io/part-of: mtc
{{- end }}

{{/* Helm's own: which chart made an object, and that Helm manages it. */}}
{{- define "mtc.helmLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Namespaced objects of the node stack. */}}
{{- define "mtc.labels" -}}
{{ include "mtc.podLabels" . }}
{{ include "mtc.helmLabels" . }}
{{- end }}

{{/* Cluster-scoped and shared objects (CRD, PriorityClass, CSIDriver, cert-manager's). */}}
{{- define "mtc.sharedLabels" -}}
app.kubernetes.io/part-of: mtc
{{ include "mtc.helmLabels" . }}
{{- end }}

{{- define "mtc.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The MTC_* settings both containers read (the ConfigMap's data). */}}
{{- define "mtc.configData" -}}
MTC_LOG_LEVEL: {{ .Values.logLevel | quote }}
MTC_RAM_SIZE: {{ .Values.ramSize | quote }}
{{- with .Values.allowedNamespaces }}
MTC_CSI_ALLOWED_NAMESPACES: {{ join "," . | quote }}
{{- end }}
{{- with .Values.allowedServiceAccounts }}
MTC_CSI_ALLOWED_SERVICE_ACCOUNTS: {{ join "," . | quote }}
{{- end }}
{{- with .Values.backup.url }}
MTC_BACKUP: {{ . | quote }}
{{- end }}
{{- with .Values.backup.registryUrl }}
MTC_REGISTRY: {{ . | quote }}
{{- end }}
{{- with .Values.backup.s3.region }}
AWS_DEFAULT_REGION: {{ . | quote }}
{{- end }}
{{- with .Values.backup.s3.endpointUrl }}
AWS_ENDPOINT_URL_S3: {{ . | quote }}
{{- end }}
{{- range $key, $value := .Values.extraConfig }}
{{ $key }}: {{ $value | quote }}
{{- end }}
{{- end }}

{{/* Refusals the schema cannot express, each with what to do instead. */}}
{{- define "mtc.checks" -}}
{{- if and .Values.namespace.create (eq .Release.Namespace .Values.namespace.name) }}
{{- fail (printf "namespace.create makes the Namespace %s, so the release cannot live in it (Helm keeps its record there before it makes anything): install with -n default (or any other existing namespace), or make the namespace yourself, label it pod-security.kubernetes.io/enforce=privileged and set namespace.create=false" .Values.namespace.name) }}
{{- end }}
{{- $owned := dict "MTC_LOG_LEVEL" "logLevel" "MTC_RAM_SIZE" "ramSize" "MTC_BACKUP" "backup.url" "MTC_REGISTRY" "backup.registryUrl" "MTC_CSI_ALLOWED_NAMESPACES" "allowedNamespaces" "MTC_CSI_ALLOWED_SERVICE_ACCOUNTS" "allowedServiceAccounts" "AWS_DEFAULT_REGION" "backup.s3.region" "AWS_ENDPOINT_URL_S3" "backup.s3.endpointUrl" }}
{{- range $key, $value := .Values.extraConfig }}
{{- if hasKey $owned $key }}
{{- fail (printf "extraConfig.%s is set by the chart: use the value %s instead" $key (get $owned $key)) }}
{{- end }}
{{- end }}
{{- if and .Values.tls.acceptSharedCertificate (ne .Values.tls.mode "cert-manager-per-node") }}
{{- fail "tls.acceptSharedCertificate is the middle step of the move to cert-manager-per-node: set tls.mode cert-manager-per-node with it" }}
{{- end }}
{{- if and .Values.controller.requireRankGrant (not (and .Values.controller.enabled (eq .Values.tls.mode "cert-manager-per-node") (not .Values.tls.acceptSharedCertificate))) }}
{{- fail "controller.requireRankGrant needs the controller (controller.enabled) and a certificate per node (tls.mode cert-manager-per-node, tls.acceptSharedCertificate false): grants name nodes" }}
{{- end }}
{{- if and (or .Values.backup.s3.region .Values.backup.s3.endpointUrl) (not (or (hasPrefix "s3://" .Values.backup.url) (hasPrefix "s3://" .Values.backup.registryUrl))) }}
{{- fail "backup.s3 is only for s3:// backup or registry URLs" }}
{{- end }}
{{- end }}

{{/* The controller's objects (deploy/components/controller). */}}
{{- define "mtc.controllerLabels" -}}
app.kubernetes.io/name: mtc-controller
app.kubernetes.io/part-of: mtc
{{ include "mtc.helmLabels" . }}
{{- end }}
